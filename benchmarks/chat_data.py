"""The packed-chat workload's data: multi-turn conversations whose token lengths spread as real SFT data does.

Each conversation's length in tokens is drawn from a lognormal with a median of 885 and 10% under 300
(sigma = ln(885 / 300) / 1.2816), cut at 8,192; it is split over one to six user/assistant turns (a system
message in a third of them), each turn's text made of words of the demo's chat vocabulary
(examples/data/chat/tokenizer.json, 512 tokens, ChatML template with generation marks), so the tokenizer
gives about the drawn length. Deterministic for a seed. The file is a JSONL of {"messages": [...]} that
SlideDP reads as `data.kind = "chat"` and the transformers peer reads through the same rows
(`chat_rows`), so both train on the same packed documents.

    python -m benchmarks.chat_data OUT_DIR [--conversations 2000] [--seed 0]

writes OUT_DIR/chat.jsonl and OUT_DIR/tokenizer.json + tokenizer_config.json, and prints the lengths' spread.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "examples" / "data" / "chat"
MEDIAN, UNDER_300, LONGEST = 885, 0.10, 8192
SIGMA = math.log(MEDIAN / 300) / 1.2816  # the 10th percentile of a normal is 1.2816 sigmas below its median
WORDS = ("the frog eats flies and worms lives in pond spider web town market open on monday recipe takes "
         "minutes flour eggs milk then bake it is ready after three plus six nine answer one sentence tell me "
         "about small known for cheese bread river bridge").split()


def turns_text(r: random.Random, tokens: int) -> list[dict[str, str]]:
    """A conversation of about `tokens` tokens (about 1.6 tokens a word in this vocabulary, 8 per turn's marks)."""
    turns = r.randint(1, 6)
    messages = [{"role": "system", "content": "Answer in one sentence."}] if r.random() < 1 / 3 else []
    words = max(2 * turns, int((tokens - 8 * 2 * turns) / 1.6))
    shares = np.random.default_rng(r.randrange(1 << 30)).dirichlet(np.ones(2 * turns)) * words
    for i, n in enumerate(shares):
        content = " ".join(r.choice(WORDS) for _ in range(max(1, int(n))))
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return messages


def write(out: Path, conversations: int, seed: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    r = random.Random(seed)
    with open(out / "chat.jsonl", "w") as f:
        for _ in range(conversations):
            tokens = min(LONGEST, max(32, int(r.lognormvariate(math.log(MEDIAN), SIGMA))))
            f.write(json.dumps({"messages": turns_text(r, tokens)}) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_DIR / name, out / name)
    return out / "chat.jsonl"


def token_lengths(folder: Path) -> np.ndarray:
    """Each conversation's length in tokens as SlideDP renders it (chat template, tokenizer)."""
    from slidedp.data.documents import DocumentSpec, read_documents
    from slidedp.data.tokenizer import TokenizerBundle

    bundle = TokenizerBundle.load(folder / "tokenizer.json", "")
    spec = DocumentSpec("chat", "text", "messages", "prompt", "completion", False, "truncate")
    docs = read_documents([str(folder / "chat.jsonl")], "jsonl", spec, bundle, 1 << 20, 512)
    return docs.lengths()


def describe(lengths: np.ndarray) -> str:
    return (f"{len(lengths)} conversations, {int(lengths.sum()):,} tokens: median {int(np.median(lengths))}, "
            f"{(lengths < 300).mean():.0%} under 300, longest {int(lengths.max())}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    write(args.out, args.conversations, args.seed)
    print(describe(token_lengths(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
