"""slidedp-store: the user's handle on stores (create, status, list, checkpoint, restore, destroy).

Requests go through the store's host-state daemon when one runs, else they are served in
this process by the same code.
"""

from __future__ import annotations

import argparse
import json
import sys

from slidedp.daemonlock import holder_pid
from slidedp import daemonlock
from slidedp.store.client import StoreRequestError, call, daemon_running
from slidedp.store.ephemeral import left_behind
from slidedp.store.shm import list_store_segments


def human_bytes(n: int) -> str:
    """1023 B, 12.0 KiB, 418.2 MiB, 83.52 GiB: readable at every store size (a tiny store is kilobytes)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            break
    return f"{value:.{2 if unit in ('GiB', 'TiB') else 1}f} {unit}"


def print_status(st: dict) -> None:
    if not st.get("exists", True):
        print(f"store {st['store']}: does not exist")
        return
    print(f"store {st['store']}")
    roles = [f"{role} {'pid %d' % daemonlock.holder_pid(st['store'], role) if daemonlock.held(st['store'], role) else 'not running'}"
             for role in daemonlock.ROLES]
    print(f"  daemons         {', '.join(roles)}")
    print(f"  model           {st['model']} ({st['family']}), {st['parameters']:,} parameters, {st['chunks']} chunks")
    for kind, size in st["segments"].items():
        print(f"  segment {kind:<11}{human_bytes(size):>11}  ({size:,} bytes)")
    total = sum(st["segments"].values())
    print(f"  {'total':<19}{human_bytes(total):>11}  ({total:,} bytes)")
    print(f"  bytes/parameter {st['bytes_per_parameter']}")
    print(f"  committed step  {st['committed_step']}")
    print(f"  state           {'TORN: ' + st['torn'] if st.get('torn') else 'clean'}")
    if not st.get("persist", True):
        creator = st.get("creator") or {}
        dead = left_behind(st)
        print(f"  persist         no: made by job {creator.get('job', '?')!r} (launcher pid {creator.get('pid', '?')}) "
              f"for itself; " + ("it is gone, so the next job with this store destroys it" if dead else "it still runs"))
    job = st.get("job") or {}
    print(f"  attached job    {('%s (launcher pid %d)' % (job.get('job'), st['attached_pid'])) if st.get('attached_pid') else 'none'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slidedp-store", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create", help="create a store from a Hugging Face folder or a random named shape")
    c.add_argument("store")
    c.add_argument("--model", required=True, help="a Hugging Face checkpoint folder, or random:SHAPE (e.g. random:tiny)")
    c.add_argument("--vocab-size", type=int, default=0, help="vocabulary size for random:SHAPE (0 = the shape's)")
    c.add_argument("--init-seed", type=int, default=0)
    c.add_argument("--chunk-rows", type=int, default=0, help="rows per embedding/head chunk (0 = one layer's size)")
    c.add_argument("--layer-chunk-numel", type=int, default=None,
                   help="cut layers larger than this many elements into chunks (0 = whole layers; default: the "
                        "layout's rule, which cuts Mixture-of-Experts layers between experts)")
    c.add_argument("--shadow-bf16", action="store_true", help="also keep a bf16 shadow of the weights (2 B/param)")
    s = sub.add_parser("status", help="model, parameters, segment sizes, committed step, attached job")
    s.add_argument("store")
    s.add_argument("--json", action="store_true")
    sub.add_parser("list", help="every store in /dev/shm")
    k = sub.add_parser("checkpoint", help="write a checkpoint of the store's committed step")
    k.add_argument("store")
    k.add_argument("dir")
    k.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    k.add_argument("--keep", type=int, default=3)
    r = sub.add_parser("restore", help="load a checkpoint into the store")
    r.add_argument("store")
    r.add_argument("path")
    d = sub.add_parser("destroy", help="remove the store's segments (its state is lost)")
    d.add_argument("store")
    d.add_argument("--force", action="store_true", help="even if a job is attached")
    args = p.parse_args(argv)
    try:
        if args.cmd == "list":
            stores = list_store_segments()
            if not stores:
                print("no stores")
            for name, segs in stores.items():
                print(f"{name}\t{human_bytes(sum(s for _, s in segs))}\t{'daemon' if daemon_running(name) else 'no daemon'}")
            return 0
        if args.cmd == "create":
            if args.model.startswith("random:"):
                src = {"source": "random", "shape": args.model[len("random:"):], "vocab_size": args.vocab_size,
                       "init_seed": args.init_seed}
            else:
                src = {"source": "hf", "path": args.model}
            st = call(args.store, "create", chunk_rows=args.chunk_rows, layer_chunk_numel=args.layer_chunk_numel,
                      shadow_bf16=args.shadow_bf16, **src)
            print(f"created store {args.store} in {st['create_s']:.2f} s (page touch {st['touch_gbps']:.2f} GB/s)")
            print_status(dict(st, daemon=daemon_running(args.store), daemon_pid=holder_pid(args.store, "hoststate")))
        elif args.cmd == "status":
            st = call(args.store, "status")
            st["daemon"] = daemon_running(args.store)
            print(json.dumps(st, indent=1) if args.json else "", end="\n" if args.json else "")
            if not st.get("exists", True):  # a script's `status NAME || create` must see it
                print(f"slidedp-store: error: store {args.store!r} does not exist (`slidedp-store list` shows the "
                      f"stores; `slidedp-store create {args.store} --model ...` makes it)", file=sys.stderr)
                return 1
            if not args.json:
                print_status(st)
        elif args.cmd == "checkpoint":
            out = call(args.store, "checkpoint", dir=args.dir, dtype=args.dtype, keep=args.keep)
            print(f"checkpoint of step {out['step']} written to {out['path']}")
        elif args.cmd == "restore":
            out = call(args.store, "restore", path=args.path)
            print(f"store {args.store} restored to step {out['step']}")
        elif args.cmd == "destroy":
            out = call(args.store, "destroy", force=args.force)
            if out.get("unreadable"):
                print(f"store {args.store} could not be read ({out['unreadable']}); removed its segments anyway")
            print(f"store {args.store} destroyed ({len(out['removed'])} segments removed)")
    except (StoreRequestError, ValueError, OSError) as e:
        print(f"slidedp-store: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
