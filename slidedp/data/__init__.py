"""The training data: from the [data] keys to batches that are a pure function of the step.

Raw token files and raw text become one token stream cut into windows; records of documents become
rows of tokens with the targets the loss is on, packed or padded. By module, in reading order:

errors     DataError, what every module here raises for data that cannot be trained on
records    records (one JSON object or table row each) from JSONL, Parquet or Arrow files
text       raw text tokenized and joined with end-of-text into one token stream
stream     the token stream (token files memory-mapped, or text) and its fixed windows
batches    global batches as a pure function of the step, and each rank's share of one
chat       chat templates rendered as `transformers` renders them, and which characters are trained
tokenizer  a tokenizer with its folder's special tokens, BOS/EOS rules and chat template
documents  records -> documents: token ids and which of them the loss is on
targets    IGNORE_INDEX, the target that trains nothing
packing    documents -> rows (packed or padded), batched like the stream's windows
setup      the launcher's entry: what a job trains on (and evaluates on), read once
serve      what a checkpoint's model/ folder needs beside the weights to be served

The worker's side (a rank's share of rows to the engine, the eval loss) is in `slidedp.worker`.
"""
