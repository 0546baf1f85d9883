"""Regenerate examples/data/chat/: small chat conversations and a 512-token tokenizer with a chat template.

Conversations ask about the facts of scripts/make_tiny_data.py (where animals live, what recipes
take, sums) and the assistant answers them, one to three turns, sometimes after a system message,
so a tiny model learns the answers quickly and the loss falls visibly. The tokenizer is a byte-level
BPE with ChatML's <|im_start|> / <|im_end|>; tokenizer_config.json carries the chat template (with
{% generation %} marks around the assistant's replies) and the special tokens, as a model folder
would. Deterministic: the same files, byte for byte, on every run.

    python scripts/make_chat_data.py [--out examples/data/chat]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_data import ANIMALS, NUMBERS, RECIPES, TOWNS  # noqa: E402

SEED = 4321
TRAIN, EVAL = 480, 48
VOCAB_SIZE = 512
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEMS = ["You are a helpful assistant.", "Answer in one sentence.", "You know about animals, food and towns."]


def question(r: random.Random) -> tuple[str, str]:
    kind = r.randrange(5)
    if kind == 0:
        name = r.choice(sorted(ANIMALS))
        return f"Where does the {name} live?", f"The {name} lives in the {ANIMALS[name][0]}."
    if kind == 1:
        name = r.choice(sorted(ANIMALS))
        return (f"What does the {name} eat?", f"The {name} eats {ANIMALS[name][1]}.")
    if kind == 2:
        dish = r.choice(sorted(RECIPES))
        ingredients, minutes, how = RECIPES[dish]
        return (f"How do I make {dish}?", f"To make {dish}, you need {ingredients}. Then {how}. "
                                         f"It is ready after {minutes} minutes.")
    if kind == 3:
        town = r.choice(sorted(TOWNS))
        place, known, day = TOWNS[town]
        return (f"Tell me about {town}.", f"{town} is a small town {place}. It is known for {known}, "
                                         f"and the market is open on {day}.")
    a, b = r.randint(0, 9), r.randint(0, 9)
    return f"What is {NUMBERS[a]} plus {NUMBERS[b]}?", f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}."


def conversation(r: random.Random) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": r.choice(SYSTEMS)}] if r.random() < 0.4 else []
    for _ in range(r.choice([1, 1, 2, 3])):
        q, a = question(r)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return messages


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {VOCAB_SIZE}")
    return tok


def tokenizer_config() -> dict:
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in enumerate(SPECIAL)}
    return {"added_tokens_decoder": added, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "unk_token": None, "chat_template": CHAT_TEMPLATE, "model_max_length": 512,
            "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "examples" / "data" / "chat")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    r = random.Random(SEED)
    convs = [conversation(r) for _ in range(TRAIN + EVAL)]
    for name, part in (("train.jsonl", convs[:TRAIN]), ("eval.jsonl", convs[TRAIN:])):
        with open(args.out / name, "w", encoding="utf-8", newline="\n") as f:
            for c in part:
                f.write(json.dumps({"messages": c}) + "\n")
    texts = [m["content"] for c in convs for m in c] + ["system", "user", "assistant"]
    tok = train_tokenizer(texts)
    (args.out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    print(f"wrote {TRAIN} + {EVAL} conversations and a {tok.get_vocab_size()}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
