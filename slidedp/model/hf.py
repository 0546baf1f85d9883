"""Hugging Face checkpoint folders: config.json + safetensors (single file or index + shards).

Headers are parsed here rather than through `safe_open` so that every lie a file can tell
(truncation, a shape that does not match its byte range, a missing shard) becomes an error
naming the file and the tensor, and so a tensor can be read straight into a caller's
buffer (a shared-memory view) without a second copy. Writing streams one tensor at a time,
so a store of any size is saved without materializing the model twice.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from slidedp.model.config import ModelConfig
from slidedp.model.hf_folder import (  # noqa: F401 (re-exported: hf.py is the folder's whole interface)
    ELEMENT_BYTES, FLOAT_TAGS as _FLOAT_TAGS, INDEX_FILE, SINGLE_FILE, CheckpointError, TensorInfo, check_folder,
    read_config, tensor_index,
)

_WRITE_PIECE = 2**24  # elements cast per write: bounds the temporary copy of a huge tensor

# safetensors dtype tag -> torch dtype (the tags of hf_folder.ELEMENT_BYTES)
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_TAG_OF = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


# ---- reading ---------------------------------------------------------------------------
def _as_bytes(t: Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def load_tensor(folder, name: str, out: Tensor | None = None, index: Mapping[str, TensorInfo] | None = None) -> Tensor:
    """Read one tensor as fp32 (into `out`, converting, if given). Pass `index` to skip re-reading headers."""
    folder = Path(folder)
    index = tensor_index(folder) if index is None else index
    if name not in index:
        raise CheckpointError(f"{folder} has no tensor {name!r}")
    info = index[name]
    path = folder / info.file
    if info.dtype not in _FLOAT_TAGS:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {info.dtype}; expected a floating-point dtype")
    if out is not None and tuple(out.shape) != info.shape:
        raise CheckpointError(f"{path}: tensor {name!r} has shape {info.shape}; the destination is {tuple(out.shape)}")
    direct = (out is not None and info.dtype == "F32" and out.dtype == torch.float32
              and out.device.type == "cpu" and out.is_contiguous())
    with torch.no_grad():
        buf = out if direct else torch.empty(info.shape, dtype=_DTYPES[info.dtype])
        view, got = _as_bytes(buf), 0
        with open(path, "rb", buffering=0) as f:
            f.seek(info.start)
            while got < info.nbytes:
                n = f.readinto(view[got:])
                if not n:
                    raise CheckpointError(f"{path} is truncated: tensor {name!r} ends early at byte {info.start + got}")
                got += n
        if direct:
            return out
        return buf.float() if out is None else out.copy_(buf)


def load_model_tensor(folder, cfg: ModelConfig, name: str, out: Tensor,
                      index: Mapping[str, TensorInfo] | None = None) -> Tensor:
    """Read the store's tensor `name` of model `cfg` from its folder into `out` (fp32): whole, or assembled
    from the pieces the folder keeps it in (one tensor per expert: expert_files.py)."""
    pieces = cfg.pieces_of(name)
    if not pieces:
        return load_tensor(folder, name, out=out, index=index)
    index = tensor_index(folder) if index is None else index
    flat = out.view(-1)
    for disk, offset, shape in pieces:
        load_tensor(folder, disk, out=flat[offset:offset + torch.Size(shape).numel()].view(shape), index=index)
    return out


# ---- writing ---------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _write_safetensors(path: Path, members: list[tuple[str, tuple[int, ...]]],
                       get: Callable[[str], Tensor], dtype: torch.dtype) -> None:
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in members:
        nbytes = itemsize * torch.Size(shape).numel()
        header[name] = {"dtype": _TAG_OF[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape in members:
            t = get(name)
            if tuple(t.shape) != shape:
                raise CheckpointError(f"write_folder: tensor {name!r} has shape {tuple(t.shape)}; "
                                      f"the config says {shape}")
            flat = t.detach().reshape(-1)
            for i in range(0, flat.numel(), _WRITE_PIECE):
                f.write(_as_bytes(flat[i:i + _WRITE_PIECE].to(device="cpu", dtype=dtype).contiguous()))
        f.flush()
        os.fsync(f.fileno())


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _replace_dir(new: Path, folder: Path) -> None:
    if not folder.exists():
        os.rename(new, folder)
    elif _rename_exchange(new, folder):
        shutil.rmtree(new)  # `new` now holds the previous checkpoint
    else:  # two renames: a crash in between leaves the old checkpoint intact under .old
        old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(folder, old)
        os.rename(new, folder)
        shutil.rmtree(old)
    fsync_dir(folder.parent)


def _read_source_config(path: Path) -> dict:
    try:
        conf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: the source config.json is not readable JSON: {e}") from None
    if not isinstance(conf, dict):
        raise CheckpointError(f"{path}: the source config.json must hold a JSON object")
    return conf


def _disk_getter(cfg: ModelConfig, get: Callable[[str], Tensor]) -> Callable[[str], Tensor]:
    """Tensors by their names on disk: a piece (expert_files.py) is a view of its store tensor, which is
    fetched once for all its pieces (they are written one after another)."""
    where = {disk: (stored, offset, shape) for disk, stored, offset, shape in cfg.disk_pieces}
    last: list = [None, None]

    def by_disk_name(name: str) -> Tensor:
        if name not in where:
            return get(name)
        stored, offset, shape = where[name]
        if last[0] != stored:
            last[:] = [stored, get(stored)]
        return last[1].reshape(-1)[offset:offset + torch.Size(shape).numel()].view(shape)

    return by_disk_name


def write_folder(folder, cfg: ModelConfig, tensors: Mapping[str, Tensor] | Callable[[str], Tensor],
                 dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 5 * 2**30,
                 extra_files: Iterable[str | os.PathLike] = ()) -> None:
    """Write a checkpoint folder loadable by `transformers`, atomically.

    `tensors` maps the store's full names to tensors, or is a callable fetched one name at a time (so a
    huge store never needs a second copy); tensors the folder keeps in pieces (one per expert) are written
    as those pieces, in the source folder's format. `extra_files` (e.g. tokenizer files) are copied in; a
    `config.json` among them is the source model's, whose fields are kept under the ones written
    here, and a `generation_config.json` replaces the one made from the config.
    An existing folder is replaced only after the new one is complete and synced, and only if
    it looks like a checkpoint (holds config.json or safetensors), so a typo cannot delete data.
    """
    folder = Path(folder)
    if dtype not in _TAG_OF:
        raise CheckpointError(f"write_folder: dtype {dtype} is not supported; use one of {list(_TAG_OF)}")
    if folder.exists() and not (folder.is_dir() and (
            not any(folder.iterdir()) or (folder / "config.json").exists() or any(folder.glob("*.safetensors")))):
        raise CheckpointError(f"{folder} exists and is not a checkpoint folder; refusing to replace it")
    get = _disk_getter(cfg, tensors if callable(tensors) else tensors.__getitem__)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = total = 0
    for name, shape in cfg.disk_shapes():
        nbytes = itemsize * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
        total += nbytes
    files = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for fname, members in zip(files, shards):
            _write_safetensors(tmp / fname, members, get, dtype)
        if len(files) > 1:
            weight_map = {name: fname for fname, members in zip(files, shards) for name, _ in members}
            _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        dtype_name = str(dtype).removeprefix("torch.")
        extra = [Path(f) for f in extra_files]
        base = next((_read_source_config(f) for f in extra if f.name == "config.json"), {})
        _write_json(tmp / "config.json", {**base, **cfg.to_hf(), "torch_dtype": dtype_name, "dtype": dtype_name})
        gen = {"_from_model_config": True, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
        _write_json(tmp / "generation_config.json", {k: v for k, v in gen.items() if v is not None})
        for src in (f for f in extra if f.name != "config.json"):
            shutil.copyfile(src, tmp / Path(src).name)
            with open(tmp / Path(src).name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        _replace_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
