"""Token streams and their batches: token files and raw text read, windows cut, batches by step, resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from slidedp.config import load_job
from slidedp.data.batches import Batches, open_batches, rank_slice
from slidedp.data.errors import DataError
from slidedp.data.stream import TokenStream, read_bin, read_npy
from slidedp.data.text import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "data" / "tokenizer.json"


def stream(n: int, vocab: int = 1000) -> TokenStream:
    return TokenStream(np.arange(n, dtype=np.int64), vocab)


def test_npy_windows_in_order_and_wrap(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(100, 123, dtype=np.uint16))  # 23 tokens -> 5 windows of 4+1
    s = TokenStream(read_npy(tmp_path / "t.npy"), 200)
    b = Batches(s, seq_len=4, global_batch=2)
    assert b.num_sequences == 5
    assert b.batch(0).tolist() == [[100, 101, 102, 103, 104], [104, 105, 106, 107, 108]]
    assert b.batch(1).tolist() == [[108, 109, 110, 111, 112], [112, 113, 114, 115, 116]]
    # step 2 takes the last window of epoch 0, then the first of epoch 1
    assert b.batch(2).tolist() == [[116, 117, 118, 119, 120], [100, 101, 102, 103, 104]]
    assert b.batch(2).dtype == np.int64 and b.batch(2).shape == (2, 5)
    assert [b.state(s) for s in (0, 2, 3)] == [
        {"epoch": 0, "position": 0, "seed": 0},
        {"epoch": 0, "position": 4, "seed": 0},
        {"epoch": 1, "position": 1, "seed": 0},
    ]
    assert [b.epoch_of(s) for s in (0, 2, 3, 5, 7)] == [0, 0, 1, 2, 2]
    json.dumps(b.state(3))


def test_npy_must_be_1d_integer(tmp_path):
    np.save(tmp_path / "f.npy", np.zeros(8, dtype=np.float32))
    with pytest.raises(DataError, match=r"f\.npy: expected a 1-D integer array of token ids, got shape \(8,\) dtype float32"):
        read_npy(tmp_path / "f.npy")
    np.save(tmp_path / "o.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match=r"o\.npy: not a readable \.npy token file"):
        read_npy(tmp_path / "o.npy")


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32", "int64"])
def test_bin_with_dtype(tmp_path, dtype):
    values = np.array([7, 65000, 3, 9, 11], dtype=dtype)
    values.astype(np.dtype(dtype).newbyteorder("<")).tofile(tmp_path / "t.bin")
    s = TokenStream(read_bin(tmp_path / "t.bin", dtype), 70000)
    assert Batches(s, seq_len=2, global_batch=1).batch(1).tolist() == [[3, 9, 11]]


def test_bin_size_must_match_dtype(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"t\.bin: size 3 bytes is not a positive multiple of 2 \(uint16\); is data\.dtype right\?"):
        read_bin(tmp_path / "t.bin", "uint16")


def test_jsonl_joined_with_eot(tmp_path):
    from tokenizers import Tokenizer

    docs = ["The fox lives in the forest.", "Two plus three is five.", "Eat it while it is warm."]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)) + "\n")
    tok = Tokenizer.from_file(str(TOKENIZER))
    eot = tok.token_to_id("<|endoftext|>")
    enc = [tok.encode(d, add_special_tokens=False).ids for d in docs]
    assert all(eot not in e for e in enc)
    assert read_jsonl(path, TOKENIZER).tolist() == enc[0] + [eot] + enc[1] + [eot] + enc[2]
    assert tok.decode(enc[0]) == docs[0]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"text": "a"}', '{"text": "b"'], r"d\.jsonl:2: bad JSON: "),
        (['{"text": "a"}', "", '{"body": "b"}'], r"d\.jsonl:3: no key 'text' \(data\.text_key\) in this record"),
        (['["text"]'], r"d\.jsonl:1: no key 'text' \(data\.text_key\) in this record"),
        (['{"text": 3}'], r"d\.jsonl:1: 'text' is int, expected a string"),
        ([""], r"d\.jsonl: no documents"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, lines, message):
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message):
        read_jsonl(tmp_path / "d.jsonl", TOKENIZER)


def test_jsonl_tokenizer_without_eot(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tok.json"))
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(DataError) as e:
        read_jsonl(tmp_path / "d.jsonl", tmp_path / "tok.json")
    assert str(e.value) == (
        f"{tmp_path / 'tok.json'}: the tokenizer has none of the end-of-text tokens "
        "<|endoftext|>, </s>, <eos>, <|end_of_text|>"
    )


def test_out_of_vocab_id():
    tokens = np.array([1, 2, 3, 99, 100, 4], dtype=np.int32)
    with pytest.raises(DataError) as e:
        TokenStream(tokens, 100, "x.npy")
    assert str(e.value) == (
        "x.npy: token id 100 at position 4 is outside the vocabulary [0, 100) of the model; "
        "does the data's tokenizer match the model?"
    )
    with pytest.raises(DataError, match=r"token id -1 at position 1 is outside"):
        TokenStream(np.array([5, -1], dtype=np.int64), 100, "x.npy")
    # the check runs in blocks: a bad id deep in a later block is found with its global position
    from slidedp.data import stream

    big = np.zeros(50, dtype=np.uint16)
    big[37] = 7
    with pytest.raises(DataError, match=r"token id 7 at position 37 "):
        stream._check_ids(big, 5, "b", block=16)


def test_too_few_sequences():
    with pytest.raises(DataError) as e:
        Batches(TokenStream(np.arange(10), 10, "t.npy"), seq_len=4, global_batch=3)
    assert str(e.value) == (
        "t.npy: 10 tokens make 2 sequences of seq_len 4 (+1 target token), fewer than train.global_batch (3); "
        "use more data or a smaller batch"
    )


def test_shuffle_is_a_seeded_permutation_per_epoch():
    s = stream(61)  # 60 // 5 = 12 sequences; 3 steps of 4 per epoch
    b = Batches(s, seq_len=5, global_batch=4, shuffle=True, seed=7)
    epochs = [np.concatenate([b.sequence_ids(st) for st in range(3 * e, 3 * e + 3)]) for e in range(3)]
    for ids in epochs:
        assert sorted(ids.tolist()) == list(range(12))
    assert epochs[0].tolist() != epochs[1].tolist() != epochs[2].tolist()
    assert epochs[0].tolist() != list(range(12))
    # rows are the windows of those sequences
    assert b.batch(4).tolist() == [list(range(5 * i, 5 * i + 6)) for i in epochs[1][4:8]]
    # deterministic across instances; another seed gives another order
    again = Batches(s, seq_len=5, global_batch=4, shuffle=True, seed=7)
    assert all(np.array_equal(again.batch(st), b.batch(st)) for st in range(9))
    other = Batches(s, seq_len=5, global_batch=4, shuffle=True, seed=8)
    assert not all(np.array_equal(other.batch(st), b.batch(st)) for st in range(3))
    assert b.state(4) == {"epoch": 1, "position": 4, "seed": 7}


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_mid_epoch_gives_the_same_stream(shuffle):
    s = stream(200)  # 199 // 6 = 33 sequences, an epoch is not a whole number of steps
    run = Batches(s, seq_len=6, global_batch=4, shuffle=shuffle, seed=3)
    uninterrupted = [run.batch(st) for st in range(20)]
    resumed = Batches(s, seq_len=6, global_batch=4, shuffle=shuffle, seed=3)
    assert resumed.state(11) == {"epoch": 1, "position": 11, "seed": 3}
    resumed.check_state(11, run.state(11))
    assert all(np.array_equal(resumed.batch(st), uninterrupted[st]) for st in range(11, 20))
    with pytest.raises(DataError, match=r"does not match \{'epoch': 1, 'position': 11, 'seed': 3\} for step 11"):
        resumed.check_state(11, run.state(10))


def test_rank_slice():
    batch = np.arange(8 * 3).reshape(8, 3)
    assert rank_slice(batch, 0, 2).tolist() == batch[:4].tolist()
    assert rank_slice(batch, 3, 4).tolist() == batch[6:].tolist()
    assert np.array_equal(np.concatenate([rank_slice(batch, r, 4) for r in range(4)]), batch)
    with pytest.raises(ValueError, match="cannot give rank 0 of 3 an equal share of a batch of 8 sequences"):
        rank_slice(batch, 0, 3)
    with pytest.raises(ValueError):
        rank_slice(batch, 2, 2)


def test_open_batches_on_the_example():
    job = load_job(ROOT / "examples" / "tiny.toml")
    b = open_batches(job, 512)
    first = b.batch(0)
    assert first.shape == (8, 65) and first.dtype == np.int64
    tokens = read_jsonl(job.data.path, job.data.tokenizer)
    assert first[0].tolist() == tokens[:65].tolist() and first[7].tolist() == tokens[7 * 64 : 8 * 64 + 1].tolist()
    assert b.num_sequences == (len(tokens) - 1) // 64 and b.num_sequences >= 60 * 8  # 60 steps: under one epoch
    with pytest.raises(DataError, match="outside the vocabulary \\[0, 300\\)"):
        open_batches(job, 300)
