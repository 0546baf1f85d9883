"""Bad SFT input: the dry run names it before anything starts, and the job file refuses what cannot work."""

from __future__ import annotations

import io
import json

import pytest

from slidedp.config import ConfigError, load_job
from slidedp.launch import dryrun

from pipeline.harness import TINY, unique_store
from data.common import CHAT, CHAT_TOKENIZER, conversations, write_model_folder

transformers = pytest.importorskip("transformers")


def dry(tmp_path, *sets: str) -> tuple[int, str]:
    job = load_job(TINY, [f'store.name="{unique_store("sdry")}"', f'run.dir="{tmp_path / "run"}"', *sets])
    out = io.StringIO()
    rc = dryrun.dry_run(job, TINY, out)
    assert not (tmp_path / "run").exists()
    return rc, out.getvalue()


def problems(text: str) -> list[str]:
    return [line.split("PROBLEM: ", 1)[1] for line in text.splitlines() if "PROBLEM: " in line]


def test_chat_data_for_a_model_folder_without_a_chat_template(tmp_path):
    folder = write_model_folder(tmp_path / "base")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    rc, text = dry(tmp_path, 'model.source="hf"', f'model.path="{folder}"', "model.vocab_size=0",
                   'data.tokenizer=""', f'data.path="{CHAT / "train.jsonl"}"', f'data.eval_path="{CHAT / "eval.jsonl"}"')
    assert rc == 1
    assert problems(text) == [
        f"{folder}: the tokenizer has no chat template (tokenizer_config.json 'chat_template', chat_template.jinja or "
        f"chat_template.json), but the data is chat ('messages' records); use a model folder with one or set "
        f"data.chat_template"]
    # data.chat_template gives it one
    template = tmp_path / "chatml.jinja"
    template.write_text(json.loads((CHAT / "tokenizer_config.json").read_text())["chat_template"])
    rc, text = dry(tmp_path, 'model.source="hf"', f'model.path="{folder}"', "model.vocab_size=0",
                   'data.tokenizer=""', f'data.path="{CHAT / "train.jsonl"}"', f'data.chat_template="{template}"')
    assert rc == 0, text


def test_the_dry_run_counts_overlong_conversations_and_says_what_packing_saves(tmp_path):
    chat = [f'data.path="{CHAT / "train.jsonl"}"', f'data.tokenizer="{CHAT_TOKENIZER}"', "train.seq_len=64"]
    rc, text = dry(tmp_path, *chat)
    assert rc == 0, text
    assert "train.jsonl (jsonl, chat): 480 of 480 documents kept (" in text
    assert "250 longer than seq_len + 1 = 65 tokens truncated" in text
    assert "480 documents in 427 rows of 64 (" in text and "packing saves 3,392 of 30,720 positions" in text
    rc, text = dry(tmp_path, *chat, 'data.overlong="drop"', 'data.packing="padded"')
    assert rc == 0 and "230 of 480 documents kept" in text and "250 longer than seq_len + 1 = 65 tokens dropped" in text


def test_a_malformed_record_is_a_problem_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = [json.dumps({"messages": c}) for c in conversations(3)]
    lines[1] = json.dumps({"messages": [{"role": "user"}]})
    bad.write_text("\n".join(lines) + "\n")
    rc, text = dry(tmp_path, f'data.path="{bad}"', f'data.tokenizer="{CHAT_TOKENIZER}"')
    assert rc == 1
    assert problems(text) == [f"{bad}:2: messages[0] (role 'user') has no string \"content\" (got nothing)"]


@pytest.mark.parametrize("sets, message", [
    (["train.eval_every=5"], "train.eval_every needs data.eval_path (the held-out data)"),
    (['data.format="npy"', 'data.kind="chat"'], "data.format = 'npy' holds token ids, not documents: data.kind must be "
                                                "'auto' or 'text' and data.packing 'auto' or 'stream'"),
    (['data.path=[]'], "data.path must be a string or a non-empty list of non-empty strings, got []"),
    (['data.packing="pack"'], "data.packing must be one of 'auto', 'stream', 'packed', 'padded'; got 'pack'"),
    (['data.overlong="cut"'], "data.overlong must be one of 'truncate', 'drop'; got 'cut'"),
    (['data.eval_path="nope.jsonl"'], "data.eval_path: eval data file '{cwd}/nope.jsonl' does not exist"),
])
def test_the_job_file_refuses(tmp_path, monkeypatch, sets, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_job(TINY, sets)
    assert str(e.value) == f"{TINY}: " + message.format(cwd=tmp_path)


def test_lists_and_folders_of_data_resolve_and_round_trip(tmp_path):
    from slidedp.config import job_to_toml

    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "a.jsonl").write_text((CHAT / "eval.jsonl").read_text())
    job = load_job(TINY, [f'data.path=["{CHAT / "train.jsonl"}", "{tmp_path / "more"}"]',
                          f'data.tokenizer="{CHAT_TOKENIZER}"', f'run.dir="{tmp_path / "run"}"'])
    assert job.data.paths == (str(CHAT / "train.jsonl"), str(tmp_path / "more"))
    (tmp_path / "job.toml").write_text(job_to_toml(job))
    assert load_job(tmp_path / "job.toml") == job
    rc, text = dry(tmp_path, f'data.path=["{CHAT / "train.jsonl"}", "{tmp_path / "more"}"]',
                   f'data.tokenizer="{CHAT_TOKENIZER}"')
    assert rc == 0 and "528 of 528 documents kept" in text, text
