"""What differs between the model a store holds and the model a job asks for, field by field.

"holds another model (random:tiny ...) than this job (random:tiny)" says nothing when only the
vocabulary differs; naming the fields (and the chunking, which the layout hash also covers) does.
"""

from __future__ import annotations

from typing import Any

from .layout import Layout


def _show(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def differences(held_model: dict[str, Any], held_chunk_rows: int | None, held_hash: str, wanted: Layout) -> list[str]:
    """Each differing field as "field: store X, job Y": the model's config, then the chunking.

    The store side comes as its status gives it (`model_config`, `chunk_rows`, `layout_hash`)."""
    a, b = held_model, wanted.model.to_dict()
    out = [f"{k}: store {_show(a.get(k))}, job {_show(b.get(k))}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if not out and held_chunk_rows is not None and held_chunk_rows != wanted.chunk_rows:  # else derived from them
        out.append(f"chunk_rows: store {held_chunk_rows}, job {wanted.chunk_rows}")
    if not out and held_hash != wanted.hash():
        out.append(f"layout: store {held_hash[:12]}, job {wanted.hash()[:12]} (another SlideDP's chunking?)")
    return out


def describe(held_model: dict[str, Any], held_chunk_rows: int | None, held_hash: str, wanted: Layout,
             limit: int = 6) -> str:
    """The differences as one clause, at most `limit` of them named."""
    diff = differences(held_model, held_chunk_rows, held_hash, wanted)
    more = f"; and {len(diff) - limit} more" if len(diff) > limit else ""
    return "; ".join(diff[:limit]) + more


def describe_layouts(held: Layout, wanted: Layout) -> str:
    return describe(held.model.to_dict(), held.chunk_rows, held.hash(), wanted)
