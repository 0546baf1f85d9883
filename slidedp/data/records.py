"""Records (one JSON object or table row each) from one file, a list of files or a folder.

JSONL is read line by line with the standard library; Parquet and Arrow (IPC file or stream, what
`datasets` writes and hub datasets ship as) through `pyarrow`, the reference reader of both formats,
a batch of rows at a time. Every record carries where it came from (`file:line` or `file row N`), so
an error about it names the place to fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DataError

# file format -> the file name endings a folder is searched for
EXTENSIONS = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",), "arrow": (".arrow",)}


@dataclass(frozen=True)
class Record:
    where: str  # "file:line" or "file row N": what an error names
    value: Any  # a dict for a well-formed record (checked by the caller)


def data_files(paths: Sequence[str], fmt: str) -> list[Path]:
    """The files of `paths` (each a file or a folder: its files of the format, sorted by name)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(EXTENSIONS[fmt]))
            if not found:
                raise DataError(f"{p}: the folder holds no {fmt} file ({', '.join(EXTENSIONS[fmt])})")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"{p}: no such file or folder")
    return out


def read_records(paths: Sequence[str], fmt: str) -> Iterator[Record]:
    for path in data_files(paths, fmt):
        yield from (_jsonl(path) if fmt == "jsonl" else _arrow(path, fmt))


def _jsonl(path: Path) -> Iterator[Record]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                value = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8: {e}") from None
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: bad JSON: {e}") from None
            yield Record(where, value)


def _arrow(path: Path, fmt: str) -> Iterator[Record]:
    try:
        import pyarrow as pa
        import pyarrow.ipc
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        raise DataError(f"{path}: reading {fmt} files needs pyarrow (pip install pyarrow)") from None
    try:
        if fmt == "parquet":
            batches = pq.ParquetFile(path).iter_batches(batch_size=4096)
        else:
            source = pa.memory_map(str(path), "r")
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # the stream format (what `datasets` writes to .arrow)
                source = pa.memory_map(str(path), "r")
                batches = iter(pa.ipc.open_stream(source))
        row = 0
        for batch in batches:
            for value in batch.to_pylist():
                yield Record(f"{path} row {row}", value)
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable {fmt} file: {e}") from None
