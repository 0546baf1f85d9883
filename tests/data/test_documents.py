"""Records -> token ids and loss masks, against what transformers makes of the same tokenizer, and every
bad input named with its file and line or row."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from slidedp.data.chat import ChatTemplate, token_mask
from slidedp.data.documents import DocumentSpec, read_documents
from slidedp.data.errors import DataError
from slidedp.data.packing import PackedRows
from slidedp.data.tokenizer import TokenizerBundle

from data.common import CHAT, CHAT_TOKENIZER, VOCAB, conversations

transformers = pytest.importorskip("transformers")

# ChatML without {% generation %} marks, with a default system turn (as Qwen2.5's template has)
PLAIN_CHATML = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TAGGED_CHATML = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# a template that uses the special-token variables and raise_exception, as Llama's and Mistral's do
BOS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + eos_token }}"
    "{% endgeneration %}{% else %}{{ '[' + message['role'] | upper + '] ' + message['content'] | tojson + ' ' }}"
    "{% endif %}{% endfor %}")


def folder_with(tmp_path, name: str, template: str | None, **config) -> tuple[object, TokenizerBundle]:
    """The demo tokenizer with another template (or none), saved by transformers; (HF tokenizer, ours)."""
    folder = tmp_path / name
    tok = transformers.AutoTokenizer.from_pretrained(CHAT)
    tok.chat_template = template
    for k, v in config.items():
        setattr(tok, k, v)
    tok.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder), TokenizerBundle.load(folder / "tokenizer.json")


def ours(bundle: TokenizerBundle, messages) -> tuple[list[int], list[int]]:
    text, spans = bundle.template.render_with_spans(messages, "test")
    enc = bundle.tokenizer.encode(text, add_special_tokens=False)
    return list(enc.ids), token_mask(enc.offsets, spans)


def theirs(tok, messages) -> tuple[list[int], list[int]]:
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


CONVERSATIONS = conversations(12) + [
    [{"role": "user", "content": "  Hi there  "}, {"role": "assistant", "content": " Hello! \n"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two?"},
     {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three plus three?"},
     {"role": "assistant", "content": "Six, \"of course\"."}],
]


def test_demo_template_matches_apply_chat_template():
    tok = transformers.AutoTokenizer.from_pretrained(CHAT)
    bundle = TokenizerBundle.load(CHAT_TOKENIZER)
    assert bundle.template is not None and bundle.template.tracks_generation
    for messages in CONVERSATIONS:
        assert ours(bundle, messages) == theirs(tok, messages)
        assert bundle.template.render(messages) == tok.apply_chat_template(messages, tokenize=False)
        assert bundle.template.render(messages[:1], add_generation_prompt=True) == tok.apply_chat_template(
            messages[:1], tokenize=False, add_generation_prompt=True)


def test_special_token_variables_and_tojson_as_transformers_renders_them(tmp_path):
    tok, bundle = folder_with(tmp_path, "bos", BOS_TEMPLATE, bos_token="<|endoftext|>")
    for messages in CONVERSATIONS:
        got, want = ours(bundle, messages), theirs(tok, messages)
        assert got == want and sum(got[1]) > 0
    with pytest.raises(DataError, match=r"where: the chat template of .* failed on this conversation: "
                                         r"TemplateError: unknown role tool"):
        bundle.template.render_with_spans([{"role": "tool", "content": "x"}], "where")


def test_template_without_generation_marks_trains_what_each_assistant_turn_adds(tmp_path):
    """The prefix method on a plain template gives the mask transformers gives the same template with marks."""
    _, plain = folder_with(tmp_path, "plain", PLAIN_CHATML)
    tagged_tok, _ = folder_with(tmp_path, "tagged", TAGGED_CHATML)
    assert not plain.template.tracks_generation
    for messages in CONVERSATIONS:
        ids, mask = ours(plain, messages)
        assert (ids, mask) == theirs(tagged_tok, messages)
        # what is trained: each reply and its <|im_end|>, nothing of the prompts
        trained = plain.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
        assert trained == "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")


def test_a_template_that_rewrites_earlier_turns_is_refused():
    rewriting = ("{% for m in messages %}{% if loop.last %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
                 "{% else %}{{ m['role'] + '. ' }}{% endif %}{% endfor %}")
    t = ChatTemplate(rewriting, {}, "model/tokenizer_config.json")
    with pytest.raises(DataError, match=r"d\.jsonl:3: the chat template of model/tokenizer_config\.json renders "
                                         r"earlier turns differently once later ones follow"):
        t.render_with_spans(CONVERSATIONS[-1], "d.jsonl:3")
    with pytest.raises(DataError, match="the chat template does not compile"):
        ChatTemplate("{% for m in messages %}", {}, "x.jinja")


def test_chat_documents_and_train_on_prompt(tmp_path):
    bundle = TokenizerBundle.load(CHAT_TOKENIZER)
    tok = transformers.AutoTokenizer.from_pretrained(CHAT)
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"messages": m, "id": i}) + "\n" for i, m in enumerate(CONVERSATIONS)))
    docs = read_documents([str(path)], "jsonl", DocumentSpec("auto"), bundle, 512, VOCAB)
    assert docs.kind == "chat" and len(docs) == len(CONVERSATIONS)
    for d, messages in enumerate(CONVERSATIONS):
        ids, mask = theirs(tok, messages)
        got_ids, got_mask = docs.document(d)
        assert got_ids.tolist() == ids and got_mask.tolist() == [0] + mask[1:]
    everything = read_documents([str(path)], "jsonl", DocumentSpec("chat", train_on_prompt=True), bundle, 512, VOCAB)
    assert everything.trained.sum() == everything.tokens.size - len(everything)  # all but each first token


def test_prompt_completion_and_text_documents(tmp_path):
    from tokenizers import Tokenizer, processors

    tok = transformers.AutoTokenizer.from_pretrained(CHAT)
    # a tokenizer whose post-processor adds a BOS, as Llama 3's does
    folder = tmp_path / "bos"
    shutil.copytree(CHAT, folder, ignore=shutil.ignore_patterns("*.jsonl"))
    raw = Tokenizer.from_file(str(CHAT_TOKENIZER))
    raw.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    raw.save(str(folder / "tokenizer.json"))
    bundle = TokenizerBundle.load(folder / "tokenizer.json")
    records = [{"prompt": "Where does the fox live?", "completion": " The fox lives in the forest."},
               {"prompt": "Two plus two is", "completion": " four."}]
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    docs = read_documents([str(path)], "jsonl", DocumentSpec("auto"), bundle, 512, VOCAB)
    assert docs.kind == "prompt_completion"
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for d, r in enumerate(records):
        p = [0] + tok(r["prompt"], add_special_tokens=False)["input_ids"]
        c = tok(r["completion"], add_special_tokens=False)["input_ids"] + [eos]
        ids, mask = docs.document(d)
        assert ids.tolist() == p + c and mask.tolist() == [0] * len(p) + [1] * len(c)
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "The cow moos."}) + "\n")
    text = read_documents([str(tmp_path / "t.jsonl")], "jsonl", DocumentSpec("auto"), bundle, 512, VOCAB)
    ids, mask = text.document(0)
    assert ids.tolist() == [0] + tok("The cow moos.", add_special_tokens=False)["input_ids"] + [eos]
    assert mask.tolist() == [0] + [1] * (len(ids) - 1)
    # add_bos_token in tokenizer_config.json (Llama 2's way) adds it where the post-processor does not
    config = json.loads((CHAT / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|im_start|>",
                                                              "add_bos_token": True}))
    shutil.copyfile(CHAT_TOKENIZER, folder / "tokenizer.json")
    bundle = TokenizerBundle.load(folder / "tokenizer.json")
    ids, _ = read_documents([str(tmp_path / "t.jsonl")], "jsonl", DocumentSpec("auto"), bundle, 512, VOCAB).document(0)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_parquet_arrow_folders_and_lists_read_the_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bundle = TokenizerBundle.load(CHAT_TOKENIZER)
    records = [{"messages": m} for m in CONVERSATIONS]
    (tmp_path / "all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    want = read_documents([str(tmp_path / "all.jsonl")], "jsonl", DocumentSpec("auto"), bundle, 512, VOCAB)
    table = pa.Table.from_pylist(records)
    (tmp_path / "pq").mkdir()
    pq.write_table(table.slice(0, 5), tmp_path / "pq" / "a.parquet")
    pq.write_table(table.slice(5), tmp_path / "pq" / "b.parquet")
    (tmp_path / "pq" / "notes.txt").write_text("not data")
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table.slice(0, 7))
        w.write_table(table.slice(7))
    for paths, fmt in (([str(tmp_path / "pq")], "parquet"), ([str(tmp_path / "file.arrow")], "arrow"),
                       ([str(tmp_path / "stream.arrow")], "arrow"),
                       ([str(tmp_path / "pq" / "a.parquet"), str(tmp_path / "pq" / "b.parquet")], "parquet")):
        got = read_documents(paths, fmt, DocumentSpec("auto"), bundle, 512, VOCAB)
        for a, b in (("tokens", "tokens"), ("trained", "trained"), ("offsets", "offsets")):
            assert np.array_equal(getattr(got, a), getattr(want, b)), (paths, a)


@pytest.mark.parametrize("lines, message", [
    (['{"messages": []}'], r"d\.jsonl:1: 'messages' must be a non-empty list of \{\"role\", \"content\"\} objects, "
                           r"got list"),
    (['{"messages": "hi"}'], r"d\.jsonl:1: 'messages' must be a non-empty list .* got str \"hi\""),
    (['{"messages": [{"role": "user", "content": "a"}]}', '{"messages": [{"content": "b"}]}'],
     r"d\.jsonl:2: messages\[0\] has no string \"role\" \(got nothing\)"),
    (['', '{"messages": [{"role": "user", "content": 3}]}'],
     r"d\.jsonl:2: messages\[0\] \(role 'user'\) has no string \"content\" \(got int 3\)"),
    (['{"messages": [{"role": "user", "content": "a"}]}', '{"messages": [1]}'],
     r"d\.jsonl:2: messages\[0\] must be an object with \"role\" and \"content\", got int 1"),
    (['{"messages": [{"role": "user", "content": "a"}]}', '{"convo": []}'],
     r"d\.jsonl:2: no key 'messages' \(data\.messages_key\) in this record; it has 'convo'"),
    (['{"messages": [{"role": "user", "content": "a"}]}', '{"messages": [}'], r"d\.jsonl:2: bad JSON: "),
])
def test_malformed_records_name_file_and_line(tmp_path, lines, message):
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message):
        read_documents([str(tmp_path / "d.jsonl")], "jsonl", DocumentSpec("chat"),
                       TokenizerBundle.load(CHAT_TOKENIZER), 512, VOCAB)


def test_malformed_rows_name_file_and_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": None}]),
                   tmp_path / "pc.parquet")
    with pytest.raises(DataError, match=r"pc\.parquet row 1: 'prompt' and 'completion' must both be strings"):
        read_documents([str(tmp_path / "pc.parquet")], "parquet", DocumentSpec("auto"),
                       TokenizerBundle.load(CHAT_TOKENIZER), 512, VOCAB)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable parquet file"):
        read_documents([str(tmp_path / "bad.parquet")], "parquet", DocumentSpec("auto"),
                       TokenizerBundle.load(CHAT_TOKENIZER), 512, VOCAB)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: the folder holds no parquet file \(\.parquet\)"):
        read_documents([str(tmp_path / "empty")], "parquet", DocumentSpec("auto"),
                       TokenizerBundle.load(CHAT_TOKENIZER), 512, VOCAB)


def test_chat_data_without_a_chat_template(tmp_path):
    _, bundle = folder_with(tmp_path, "none", None)
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    with pytest.raises(DataError, match=r"the tokenizer has no chat template .* but the data is chat \('messages' "
                                         r"records\); use a model folder with one or set data\.chat_template"):
        read_documents([str(tmp_path / "c.jsonl")], "jsonl", DocumentSpec("auto"), bundle, 512, VOCAB)


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_conversations_are_truncated_or_dropped_and_counted(tmp_path, overlong):
    bundle = TokenizerBundle.load(CHAT_TOKENIZER)
    lengths = [len(ours(bundle, m)[0]) for m in CONVERSATIONS]
    seq_len = sorted(lengths)[len(lengths) // 2]  # about half are longer than seq_len + 1
    long = sum(n > seq_len + 1 for n in lengths)
    assert 0 < long < len(lengths)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    docs = read_documents([str(tmp_path / "c.jsonl")], "jsonl", DocumentSpec("chat", overlong=overlong), bundle,
                          seq_len, VOCAB)
    s = docs.stats
    assert s.read == len(CONVERSATIONS)
    if overlong == "drop":
        assert (s.dropped_overlong, s.truncated, s.kept) == (long, 0, len(CONVERSATIONS) - long)
        assert f"{long} longer than seq_len + 1 = {seq_len + 1} tokens dropped" in s.describe(seq_len)
    else:
        # a truncated conversation whose cut leaves no assistant token is left out too, and counted
        assert s.truncated == long and s.kept + s.dropped_untrained == len(CONVERSATIONS)
        assert f"{long} longer than seq_len + 1 = {seq_len + 1} tokens truncated" in s.describe(seq_len)
    assert int(docs.lengths().max()) <= seq_len + 1
    PackedRows.build(docs, seq_len, packed=True)  # every document fits a row


def test_conversational_prompt_completion_trains_the_completion_turns(tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(CHAT)
    bundle = TokenizerBundle.load(CHAT_TOKENIZER)
    messages = CONVERSATIONS[-1]
    record = {"prompt": messages[:-1], "completion": messages[-1:]}
    (tmp_path / "pc.jsonl").write_text(json.dumps(record) + "\n")
    docs = read_documents([str(tmp_path / "pc.jsonl")], "jsonl", DocumentSpec("auto"), bundle, 512, VOCAB)
    assert docs.kind == "prompt_completion"
    ids, mask = docs.document(0)
    want_ids, want_mask = theirs(tok, messages)
    assert ids.tolist() == want_ids
    # only the completion's turn (the last assistant reply and its <|im_end|>), not the earlier reply
    last = [0] * len(want_mask)
    at = max(i for i in range(len(want_mask)) if want_mask[i] and not want_mask[i - 1])
    last[at:] = want_mask[at:]
    assert mask.tolist() == last and 0 < sum(last) < sum(want_mask)
