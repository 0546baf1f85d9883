"""What differs between the model a store holds and the model a job asks for, field by field.

"holds another model (random:tiny ...) than this job (random:tiny)" says nothing when only the
vocabulary differs; naming the fields (and the chunking, which the layout hash also covers) does.
"""

from __future__ import annotations

from typing import Any

from .layout import Layout


def _show(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def _split(numel: int) -> str:
    return f"{numel:,} (layers cut into chunks of at most that many elements)" if numel else "0 (one chunk a layer)"


def differences(held_model: dict[str, Any], held_chunk_rows: int | None, held_hash: str, wanted: Layout,
                held_layer_chunk_numel: int | None = None) -> list[str]:
    """Each differing field as "field: store X, job Y": the model's config, then the chunking.

    The store side comes as its status gives it (`model_config`, `chunk_rows`, `layer_chunk_numel`,
    `layout_hash`)."""
    a, b = held_model, wanted.model.to_dict()
    out = [f"{k}: store {_show(a.get(k))}, job {_show(b.get(k))}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if not out and held_layer_chunk_numel is not None and held_layer_chunk_numel != wanted.layer_chunk_numel:
        out.append(f"layer_chunk_numel: store {_split(held_layer_chunk_numel)}, job {_split(wanted.layer_chunk_numel)}"
                   " (plan.layer_chunk_numel)")
    if not out and held_chunk_rows is not None and held_chunk_rows != wanted.chunk_rows:  # else derived from them
        out.append(f"chunk_rows: store {held_chunk_rows}, job {wanted.chunk_rows}")
    if not out and held_hash != wanted.hash():
        out.append(f"layout: store {held_hash[:12]}, job {wanted.hash()[:12]} (another SlideDP's chunking?)")
    return out


def describe(held_model: dict[str, Any], held_chunk_rows: int | None, held_hash: str, wanted: Layout,
             limit: int = 6, held_layer_chunk_numel: int | None = None) -> str:
    """The differences as one clause, at most `limit` of them named."""
    diff = differences(held_model, held_chunk_rows, held_hash, wanted, held_layer_chunk_numel)
    more = f"; and {len(diff) - limit} more" if len(diff) > limit else ""
    return "; ".join(diff[:limit]) + more


def describe_layouts(held: Layout, wanted: Layout) -> str:
    return describe(held.model.to_dict(), held.chunk_rows, held.hash(), wanted,
                    held_layer_chunk_numel=held.layer_chunk_numel)
