"""Supervised fine-tuning data: records from JSONL/Parquet/Arrow files, chat templates and loss masks,
documents packed into sequences (or padded one per sequence), batched as a pure function of the step."""
