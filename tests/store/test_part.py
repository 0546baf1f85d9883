"""A host's part of the state on several hosts (store/part.py): which ranges, what is in them, what it takes.

The part's ranges must be exactly what the reduce_scatter route hands the host's ranks (their shards of
every chunk, side by side), its store must hold the whole store's values there and nothing elsewhere, and
only those pages may take memory.
"""

from __future__ import annotations

import os

import pytest
import torch

from slidedp.model.config import named_shape
from slidedp.store.layout import Shard, make_layout
from slidedp.store.part import StorePart, overlaps
from slidedp.store.shm import SHM_DIR, page_ranges
from slidedp.store.store import STATE_KINDS, HostStore, fill_random, held_sizes

from . import cleanup_store, unique_store

SHAPE = named_shape("small")


@pytest.mark.parametrize("hosts,ranks", [(2, 1), (2, 4), (3, 2), (4, 3)])
def test_a_part_is_its_ranks_shards_side_by_side(hosts, ranks):
    layout = make_layout(SHAPE)
    for numel in [1, 2, 5, 7, 64, 1000, 12_345] + [c.numel for c in layout.chunks[:3]]:
        covered = []
        for host in range(hosts):
            lo, hi = StorePart(hosts, host, ranks).chunk_range(numel)
            shards = [Shard(numel, hosts * ranks, host * ranks + r) for r in range(ranks)]
            assert (lo, hi) == (shards[0].start, shards[-1].end), (numel, host)
            covered.append((lo, hi))
        # the hosts' ranges tile the chunk in order
        assert covered[0][0] == 0 and covered[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


def test_overlaps_cut_a_span_by_sorted_ranges():
    ranges = [(0, 10), (20, 30), (40, 50)]
    assert overlaps(ranges, 5, 45) == [(5, 10), (20, 30), (40, 45)]
    assert overlaps(ranges, 10, 20) == []
    assert overlaps(ranges, 25, 26) == [(25, 26)]


def _allocated(name: str, kind: str) -> int:
    return os.stat(os.path.join(SHM_DIR, f"slidedp.{name}.{kind}")).st_blocks * 512


def _page() -> int:
    """The unit tmpfs may give pages in here: 4 KiB, or 2 MiB where it may hand out huge pages."""
    try:
        policy = open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read()
        mounts = [line.split() for line in open("/proc/mounts")]
    except OSError:
        return 2 << 20
    chosen = policy[policy.index("[") + 1:policy.index("]")] if "[" in policy else "always"
    options = next((m[3] for m in mounts if len(m) > 3 and m[1] == SHM_DIR), "")
    huge_mount = any(o.startswith("huge=") and o != "huge=never" for o in options.split(","))
    return 4096 if chosen in ("never", "deny") and not huge_mount else 2 << 20


@pytest.fixture
def stores():
    names: list[str] = []
    yield lambda prefix: names.append(unique_store(prefix)) or names[-1]
    for n in names:
        cleanup_store(n)


def test_a_part_store_holds_its_ranges_of_the_whole_store_and_takes_only_their_pages(stores):
    layout = make_layout(SHAPE)
    meta = {"source": "random:small", "init_seed": 7}
    whole = HostStore.create(stores("whole"), layout, meta, shadow=True, fill=fill_random(7, 2))
    parts = [HostStore.create(stores(f"part{h}"), layout, meta, shadow=True, fill=fill_random(7, 2),
                              part=StorePart(3, h, 2)) for h in range(3)]
    try:
        for h, st in enumerate(parts):  # first, before anything reads them (a read of a hole takes a page too)
            owned = StorePart(3, h, 2).ranges(layout)
            # memory: the pages of its ranges (whole pages; 2 MiB where tmpfs may give huge pages), not the rest
            for kind in STATE_KINDS + ("shadow",):
                elt = 2 if kind == "shadow" else 4
                pages = page_ranges([(a * elt, b * elt) for a, b in owned], _page())
                assert _allocated(st.name, kind) <= sum(b - a for a, b in pages), (h, kind)
                if _page() == 4096:  # a third of it and its page edges (here: 5.3 MB of the master's 15.8 MB)
                    assert _allocated(st.name, kind) < 0.35 * layout.total_numel * elt, (h, kind)
        for h, st in enumerate(parts):
            part = StorePart(3, h, 2)
            assert st.part == part and st.status()["part"] == part.to_dict()
            owned = part.ranges(layout)
            mask = torch.zeros(layout.total_numel, dtype=torch.bool)
            for a, b in owned:
                mask[a:b] = True
            for kind in ("master", "shadow"):
                got, want = st.flat(kind), whole.flat(kind)
                assert torch.equal(got[mask], want[mask]), (h, kind)
                assert not got[~mask].any(), (h, kind)  # never written
            for kind in ("exp_avg", "exp_avg_sq"):
                assert not st.flat(kind).any()
        # the three parts' ranges together are every element once
        counts = torch.zeros(layout.total_numel, dtype=torch.int32)
        for h in range(3):
            for a, b in StorePart(3, h, 2).ranges(layout):
                counts[a:b] += 1
        assert bool((counts == 1).all())
        assert held_sizes(layout, {}, True, StorePart(3, 0, 2))["master"] == StorePart(3, 0, 2).numel(layout) * 4
    finally:
        whole.close()
        for st in parts:
            st.close()
