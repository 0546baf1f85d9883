"""The host store in this process: create from transformers folders, checkpoint/restore, destroy, space, corruption.

Requests go through `slidedp.store.client.call` with no daemon running, so they are served by
the daemon's own code (HostStateCore) in this process; what is in /dev/shm is read back with
HostStore.attach and os.listdir.
"""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
import torch

from slidedp.model.config import named_shape
from slidedp.paths import run_dir
from slidedp.store.client import StoreRequestError, call
from slidedp.store.layout import Layout, make_layout
from slidedp.store.manifest import _FIXED, PAGE, ManifestError
from slidedp.store.shm import SHM_DIR, Segment, shm_free_bytes
from slidedp.store.store import STATE_KINDS, HostStore, StoreError, segment_sizes

from . import bits, cleanup_store, shm_entries, unique_store

transformers = pytest.importorskip("transformers")

TINY = named_shape("tiny")
KINDS_4 = ["exp_avg", "exp_avg_sq", "manifest", "master"]


@pytest.fixture
def store():
    name = unique_store("st")
    try:
        yield name
    finally:
        cleanup_store(name)


def attached(name: str) -> HostStore:
    return HostStore.attach(name)


# ---- create from a transformers-written folder -------------------------------------------------
def _hf_model(family: str):
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True))
    with torch.no_grad():  # noise everywhere: norms are not all 1, so a swapped tensor cannot pass
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.float()


@pytest.mark.parametrize("family,shard", [("llama", None), ("qwen3", "60KB")], ids=["llama-single", "qwen3-tied-sharded"])
def test_create_from_transformers_folder_is_bit_exact(tmp_path, store, family, shard):
    model = _hf_model(family)
    folder = tmp_path / "hf"
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if shard:
        assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file(), shards
    else:
        assert shards == ["model.safetensors"]
    expected = {n: p.detach() for n, p in model.named_parameters()}  # tied head: listed once

    st = call(store, "create", source="hf", path=str(folder))
    assert st["model"] == f"hf:{folder}" and st["family"] == family
    assert st["parameters"] == sum(t.numel() for t in expected.values())
    assert shm_entries(store) == [f"slidedp.{store}.{k}" for k in KINDS_4]

    s = attached(store)
    try:
        names = [n for n, _ in s.tensors("master")]
        assert sorted(names) == sorted(expected)
        for name in names:
            got = s.tensor("master", name)
            assert got.shape == expected[name].shape, name
            assert torch.equal(bits(got), bits(expected[name])), f"{name} differs"
        for kind in ("exp_avg", "exp_avg_sq"):
            assert int(torch.count_nonzero(s.flat(kind))) == 0, kind
        m = s.manifest
        assert m.committed_step == 0 and m.torn_flag == 0 and m.attached_pid == 0
        assert m.versions.tolist() == [0] * len(s.layout.chunks)
        assert m.adam_steps.tolist() == [0] * len(s.layout.chunks)
        assert m.updating.tolist() == [0] * len(s.layout.chunks)
        assert m.torn_reason() is None
    finally:
        s.close()


@pytest.mark.parametrize("threads", [1, 4])
def test_random_store_is_init_params_bit_for_bit(store, threads):
    # the fill runs a tensor per thread: the values must not depend on which thread or in what order
    from slidedp.model.init import init_params
    from slidedp.store.store import fill_random

    layout = make_layout(TINY)
    made = HostStore.create(store, layout, {"source": "random:tiny", "init_seed": 3}, fill=fill_random(3, threads))
    try:
        want = init_params(TINY, 3)
        got = dict(made.tensors("master"))
        assert list(got) == list(want)
        for name, ref in want.items():
            assert torch.equal(got[name], ref), name
        assert not any(made.flat(k).any() for k in ("exp_avg", "exp_avg_sq"))
    finally:
        made.close()



def test_a_torn_store_names_every_chunk_state_that_tears_it(store):
    # a worker holding layer chunks killed mid-step, while other chunks' speculative updates wait for the
    # norm: both are named, whichever the kill came nearer
    from slidedp.store.manifest import LEASED, SPECULATIVE

    made = HostStore.create(store, make_layout(TINY), {"source": "random:tiny", "init_seed": 0})
    try:
        m = made.manifest
        assert m.torn_reason() is None
        m.updating[1] = LEASED
        assert m.torn_reason() == ("chunk(s) [1] are held on a job's GPUs and were not written back (the job ended "
                                   "without finishing)")
        m.updating[2] = m.updating[3] = SPECULATIVE
        assert m.torn_reason() == ("chunk(s) [2, 3] hold a speculative update that was never validated against the "
                                   "step's gradient norm (the updater or aggregator stopped); chunk(s) [1] are held "
                                   "on a job's GPUs and were not written back (the job ended without finishing)")
        assert m.torn_reason(allow_leased=True).startswith("chunk(s) [2, 3] hold a speculative update")
        assert "held on a job's GPUs" not in m.torn_reason(allow_leased=True)
        m.updating[:] = 0
    finally:
        made.close()



# ---- checkpoint, then restore into a new store ----------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_checkpoint_restore_into_new_store(tmp_path, dtype):
    a, b = unique_store("cka"), unique_store("ckb")
    try:
        call(a, "create", source="random", shape="tiny", init_seed=0)
        s = attached(a)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, view in s.tensors("master"):
                view.add_(0.01 * torch.randn(view.shape, generator=gen))
            for name, view in s.tensors("exp_avg"):
                view.copy_(1e-3 * torch.randn(view.shape, generator=gen))
            for name, view in s.tensors("exp_avg_sq"):
                view.copy_(1e-6 * torch.rand(view.shape, generator=gen))
            first = s.tensor("master", "model.norm.weight").view(-1)
            first[0], first[1] = -0.0, 1e-40  # a signed zero and a subnormal must survive too
        chunks = len(s.layout.chunks)
        s.manifest.adam_steps[:] = [3 + c for c in range(chunks)]
        s.manifest.versions[:] = 7
        s.manifest.set_committed_step(7)
        want = {k: {n: bits(v) for n, v in s.tensors(k)} for k in STATE_KINDS}
        s.close()

        out = call(a, "checkpoint", dir=str(tmp_path / "ck"), dtype=dtype)
        path = tmp_path / "ck" / "step-00000007"
        assert out == {"path": str(path), "step": 7}
        assert call(a, "destroy")["removed"] and shm_entries(a) == []

        call(b, "create", source="random", shape="tiny", init_seed=5)
        s = attached(b)
        assert not torch.equal(bits(s.tensor("master", "model.embed_tokens.weight")),
                               want["master"]["model.embed_tokens.weight"])
        s.close()
        restored = call(b, "restore", path=str(path))  # the checkpoint says whose state it is (store a's)
        assert restored["step"] == 7 and restored["extra"].keys() == {"store", "store_generation"}
        assert restored["extra"]["store"] == a and isinstance(restored["extra"]["store_generation"], int)
        s = attached(b)
        try:
            for kind in STATE_KINDS:
                for name, view in s.tensors(kind):
                    assert torch.equal(bits(view), want[kind][name]), f"{kind} {name} differs after restore"
            m = s.manifest
            assert m.adam_steps.tolist() == [3 + c for c in range(chunks)]
            assert m.versions.tolist() == [7] * chunks
            assert m.committed_step == 7 and m.torn_reason() is None
        finally:
            s.close()

        # The checkpoint's model/ is a transformers folder holding the same weights (bf16-rounded for bf16).
        model = transformers.AutoModelForCausalLM.from_pretrained(path / "model", dtype=torch.float32)
        assert type(model).__name__ == "Qwen3ForCausalLM"
        sd = model.state_dict()
        for name, ref in want["master"].items():
            w = ref.view(torch.float32)
            if dtype == "bf16":
                w = w.to(torch.bfloat16).float()
            assert torch.equal(bits(sd[name]), bits(w)), f"transformers sees another {name}"
    finally:
        cleanup_store(a)
        cleanup_store(b)


# ---- destroy ---------------------------------------------------------------------------------------
def test_destroy_leaves_nothing_in_dev_shm(store):
    call(store, "create", source="random", shape="tiny")
    att = call(store, "attach", job="j", pid=os.getpid(), world=2)  # adds the job's gradient rings
    before = shm_entries(store)
    assert set(KINDS_4) < {e.rsplit(".", 1)[1] for e in before} and len(before) > 4, before
    with pytest.raises(StoreRequestError) as e:
        call(store, "destroy")
    assert str(e.value) == f"destroy refused: a job (pid {os.getpid()}) is attached to store {store!r}"
    assert shm_entries(store) == before
    out = call(store, "destroy", force=True)
    assert sorted(out["removed"]) == sorted("/" + e for e in before)
    assert [e for e in os.listdir(SHM_DIR) if e.startswith(f"slidedp.{store}.")] == []
    assert att["committed_step"] == 0


# ---- too big for /dev/shm ----------------------------------------------------------------------------
def test_too_big_store_refused_before_any_segment(store):
    layout = make_layout(named_shape("qwen3-14b"))
    meta = {"source": "random:qwen3-14b", "init_seed": 0, "shadow": False, "created": time.time()}
    needed = sum(segment_sizes(layout, meta, False).values())
    free = shm_free_bytes()
    if needed <= free:
        pytest.skip(f"/dev/shm has {free / 2**30:.1f} GiB free: qwen3-14b fits here")
    with pytest.raises(StoreRequestError) as e:
        call(store, "create", source="random", shape="qwen3-14b")
    msg = str(e.value)
    assert msg.startswith(f"store {store!r} (14.768 B parameters) needs {needed / 2**30:.2f} GiB of shared memory "
                          f"but /dev/shm has only "), msg
    assert "GiB free; enlarge it (e.g. `mount -o remount,size=<N>G /dev/shm`)" in msg
    assert needed / 2**30 > 160  # 14.77 B params x 12 B
    assert shm_entries(store) == []


# ---- permissions -------------------------------------------------------------------------------------
def test_segments_0600_and_run_dir_0700(store):
    d = run_dir(store)
    (d / "in-use").touch()  # a file of someone's keeps the dir after the requests (an idle one is removed)
    os.chmod(d, 0o755)  # loosened by someone: the next use makes it private again
    old = os.umask(0)  # the most permissive umask must not widen the segments
    try:
        call(store, "create", source="random", shape="tiny")
        call(store, "attach", job="j", pid=os.getpid(), world=2)
    finally:
        os.umask(old)
    entries = shm_entries(store)
    assert len(entries) > 4
    modes = {e: oct(stat.S_IMODE(os.stat(os.path.join(SHM_DIR, e)).st_mode)) for e in entries}
    assert set(modes.values()) == {"0o600"}, modes
    assert all(os.stat(os.path.join(SHM_DIR, e)).st_uid == os.getuid() for e in entries)
    assert oct(stat.S_IMODE(os.stat(d).st_mode)) == "0o700"


# ---- corruption -----------------------------------------------------------------------------------------
def _body(seg: Segment) -> tuple[int, bytes]:
    body_len = _FIXED.unpack_from(seg.mm, 0)[5]
    return body_len, bytes(seg.mm[PAGE:PAGE + body_len])


def _corrupt(store: str, how: str) -> tuple[type[Exception], str]:
    """Damage the store; returns the error attach must raise and its exact message (or prefix, ending in '(')."""
    man = f"/slidedp.{store}.manifest"
    seg = Segment.open(man)
    try:
        header_hash = _FIXED.unpack_from(seg.mm, 0)[4].decode()
        n, body = _body(seg)
        if how == "magic":
            seg.mm[0:1] = b"X"
            return ManifestError, f"manifest {man} is corrupt: bad magic b'XLIDEDP\\x01' (expected b'SLIDEDP\\x01')"
        if how == "layout-byte":  # still valid JSON: only the hash can tell
            at = body.index(b'"model.norm.weight"') + len('"model.n')
            seg.mm[PAGE + at:PAGE + at + 1] = b"N"
            new = Layout.from_dict(json.loads(bytes(seg.mm[PAGE:PAGE + n]))["layout"]).hash()
            assert new != header_hash
            return ManifestError, (f"manifest {man} is corrupt: layout hash mismatch (header {header_hash[:16]}..., "
                                   f"layout {new[:16]}...)")
        if how == "layout-json":
            seg.mm[PAGE:PAGE + 1] = b"]"
            return ManifestError, f"manifest {man} is corrupt: layout unreadable ("
        if how == "master-size":
            size = os.stat(f"{SHM_DIR}/slidedp.{store}.master").st_size
            os.truncate(f"{SHM_DIR}/slidedp.{store}.master", size - 4096)
            return StoreError, (f"store {store!r}: segment /slidedp.{store}.master is {size - 4096} bytes, "
                                f"the manifest's layout needs {size}")
        raise AssertionError(how)
    finally:
        seg.close()


@pytest.mark.parametrize("how", ["magic", "layout-byte", "layout-json", "master-size"])
def test_corrupt_store_is_named_and_can_be_destroyed(store, how):
    call(store, "create", source="random", shape="tiny")
    err, msg = _corrupt(store, how)
    with pytest.raises(err) as e:
        HostStore.attach(store)
    if msg.endswith("("):
        assert str(e.value).startswith(msg), str(e.value)
    else:
        assert str(e.value) == msg
    with pytest.raises(StoreRequestError) as e2:  # the client (slidedp-store, the launcher) gets it as a refusal
        call(store, "status")
    assert str(e2.value) == f"{e.value} (`slidedp-store destroy {store}` removes it)"
    assert shm_entries(store) == [f"slidedp.{store}.{k}" for k in KINDS_4]  # nothing touched by the refusal
    out = call(store, "destroy")
    assert out["unreadable"] == str(e.value)
    assert sorted(out["removed"]) == [f"/slidedp.{store}.{k}" for k in KINDS_4]
    assert shm_entries(store) == []
