"""Regenerate examples/data/: a small templated English corpus and a 512-token byte-level BPE.

The text is original and generated from templates over a fixed set of facts (each animal
always lives in the same place, each recipe always takes the same ingredients, sums are
right), so a tiny model learns it quickly and the loss falls visibly. Deterministic: the
same files, byte for byte, on every run.

    python scripts/make_tiny_data.py [--out examples/data]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 1234
NUM_DOCS = 600
VOCAB_SIZE = 512
EOT = "<|endoftext|>"

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]

# animal: (home, food, colour, sound, legs)
ANIMALS = {
    "fox": ("forest", "mice and berries", "red", "barks", 4),
    "owl": ("old oak tree", "mice and beetles", "brown", "hoots", 2),
    "duck": ("pond", "seeds and snails", "white", "quacks", 2),
    "cow": ("green field", "grass and hay", "black and white", "moos", 4),
    "frog": ("pond", "flies and worms", "green", "croaks", 4),
    "bee": ("hive", "nectar from flowers", "yellow and black", "buzzes", 6),
    "horse": ("stable", "oats and hay", "brown", "neighs", 4),
    "cat": ("warm house", "fish and milk", "grey", "purrs", 4),
    "goat": ("rocky hill", "grass and leaves", "white", "bleats", 4),
    "spider": ("corner of the barn", "flies", "black", "makes no sound", 8),
}

# dish: (ingredients, minutes, how)
RECIPES = {
    "bread": ("flour, water, salt and yeast", 40, "bake it in a hot oven"),
    "soup": ("carrots, onions, beans and water", 30, "cook it slowly in a big pot"),
    "pancakes": ("flour, milk, eggs and butter", 10, "fry them in a pan"),
    "rice": ("rice, water and a little salt", 20, "boil it with the lid on"),
    "salad": ("tomatoes, lettuce, oil and lemon", 5, "mix it in a bowl"),
    "cake": ("flour, sugar, eggs and butter", 45, "bake it until it is golden"),
}

# town: (place, known for, market day)
TOWNS = {
    "Brindle": ("by the river", "its old stone bridge", "Monday"),
    "Ottering": ("in the hills", "its sheep and wool", "Tuesday"),
    "Calder Vale": ("near the sea", "its boats and fish", "Wednesday"),
    "Ashby Cross": ("on the plain", "its wheat fields", "Thursday"),
    "Fennick": ("in the valley", "its apple orchards", "Friday"),
    "Morrow Bay": ("on the coast", "its tall lighthouse", "Saturday"),
}

PEOPLE = ["Anna", "Ben", "Clara", "David", "Ella", "Finn", "Grace", "Hugo", "Iris", "Jonas"]
PLACES = ["the library", "the market", "the park", "the school", "the station", "the beach", "the garden"]
THINGS = {"the library": "a book about stars", "the market": "a bag of apples", "the park": "a red kite",
          "the school": "a new pencil", "the station": "a ticket to the city", "the beach": "a white shell",
          "the garden": "a basket of beans"}
WEATHER = {"sunny": "warm", "rainy": "wet", "windy": "cold", "cloudy": "grey", "snowy": "very cold"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def animal_doc(r: random.Random) -> list[str]:
    name = r.choice(sorted(ANIMALS))
    home, food, colour, sound, legs = ANIMALS[name]
    article = "An" if name[0] in "aeiou" else "A"
    rest = [f"It eats {food}.", f"The {name} is {colour}.", f"{article} {name} has {NUMBERS[legs]} legs.",
            f"The {name} {sound}."]
    r.shuffle(rest)
    return [f"The {name} lives in the {home}."] + rest[: r.randint(2, 4)]


def recipe_doc(r: random.Random) -> list[str]:
    dish = r.choice(sorted(RECIPES))
    ingredients, minutes, how = RECIPES[dish]
    return [f"To make {dish}, you need {ingredients}.", f"First, mix the {ingredients}.",
            f"Then {how}.", f"The {dish} is ready after {minutes} minutes.", "Eat it while it is warm."]


def town_doc(r: random.Random) -> list[str]:
    town = r.choice(sorted(TOWNS))
    place, known, day = TOWNS[town]
    s = [f"{town} is a small town {place}.", f"{town} is known for {known}.",
         f"The market in {town} is open on {day}.", f"Many people visit {town} in the summer."]
    return s[: r.randint(2, 4)]


def sums_doc(r: random.Random) -> list[str]:
    out = []
    for _ in range(r.randint(3, 6)):
        a, b = r.randint(0, 9), r.randint(0, 9)
        if r.random() < 0.5:
            out.append(f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}.")
        else:
            a, b = max(a, b), min(a, b)
            out.append(f"{NUMBERS[a].capitalize()} minus {NUMBERS[b]} is {NUMBERS[a - b]}.")
    return out


def story_doc(r: random.Random) -> list[str]:
    who, place, day = r.choice(PEOPLE), r.choice(PLACES), r.choice(DAYS)
    weather = r.choice(sorted(WEATHER))
    friend = r.choice([p for p in PEOPLE if p != who])
    hour = r.randint(2, 9)
    return [f"On {day} it was {weather} and {WEATHER[weather]}.", f"{who} went to {place} with {friend}.",
            f"There {who} found {THINGS[place]}.", f"{who} and {friend} came home at {NUMBERS[hour]} o'clock.",
            f"It was a good day for {who}."]


GENERATORS = [animal_doc, recipe_doc, town_doc, sums_doc, story_doc]


def make_corpus(num_docs: int = NUM_DOCS, seed: int = SEED) -> list[str]:
    r = random.Random(seed)
    docs = []
    for _ in range(num_docs):
        sentences = []
        for _ in range(r.randint(1, 3)):
            sentences += r.choice(GENERATORS)(r)
        docs.append(" ".join(sentences))
    return docs


def train_tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE or tok.token_to_id(EOT) is None:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {VOCAB_SIZE} including {EOT}")
    return tok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "examples" / "data")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    docs = make_corpus()
    with open(args.out / "tiny.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    tok = train_tokenizer(docs)
    (args.out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    n = sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False))
    print(f"wrote {len(docs)} documents ({n} tokens) and a {tok.get_vocab_size()}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
