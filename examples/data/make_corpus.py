"""Generate examples/data/fables.txt: a small, original, public-domain text for train_gpt.py.

The text is produced by a tiny grammar of fable-like sentences (written for this repo; nothing is
downloaded), so a character-level model has real structure to learn: words, spelling,
punctuation, recurring names and phrases. Deterministic: the same seed gives the same bytes.

    python examples/data/make_corpus.py            # rewrites examples/data/fables.txt
"""
from __future__ import annotations

import argparse
import pathlib
import random
import textwrap

ANIMALS = ["fox", "crow", "hare", "tortoise", "wolf", "lamb", "ant", "grasshopper", "lion",
           "mouse", "heron", "frog", "goat", "donkey", "owl", "badger", "otter", "sparrow"]
PLACES = ["by the river", "in the old orchard", "at the edge of the wood", "on the hill",
          "near the mill", "under the oak", "beside the well", "in the meadow",
          "on the frozen pond", "behind the barn"]
TIMES = ["One morning", "Late in the autumn", "On a hot afternoon", "When the snow came",
         "At the first light", "Long ago", "In the dry season", "One windy evening"]
WANTS = ["a piece of cheese", "a warm place to sleep", "the ripest grapes", "a drink of water",
         "a bag of grain", "the shining feather", "a safe road home", "the last apple",
         "a song to sing", "a friend to talk to"]
ADJ = ["clever", "proud", "patient", "hungry", "foolish", "kind", "greedy", "careful", "old",
       "young", "quick", "lazy", "honest", "boastful", "quiet"]
VERBS_PAST = ["laughed", "waited", "listened", "ran off", "sat down", "looked away", "sighed",
              "thought for a while", "bowed", "shook its head"]
SUPERLATIVES = ["wisest", "bravest", "kindest", "finest", "strongest", "quickest", "cleverest",
                "happiest", "gentlest", "noblest"]
SAYINGS = ["Slow and steady wins the race.", "Look before you leap.",
           "A friend in need is a friend indeed.", "Pride comes before a fall.",
           "Do not count your eggs before they hatch.", "Little by little, the work is done.",
           "Kindness is never wasted.", "Those who boast are seldom brave.",
           "Plan today for the winter that comes.", "A small gift given gladly is a great gift.",
           "Better to share than to lose it all.", "The quiet ones often know the most."]


def a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def fable(rng: random.Random, number: int) -> str:
    x, y = rng.sample(ANIMALS, 2)
    ax, ay = rng.sample(ADJ, 2)
    want = rng.choice(WANTS)
    place = rng.choice(PLACES)
    lines = [f"FABLE {number}. THE {ax.upper()} {x.upper()} AND THE {y.upper()}", ""]
    para = [f"{rng.choice(TIMES)}, {a(ax)} {x} was walking {place}, looking for {want}."]
    para.append(f"There it met {a(ay)} {y}, who had found {want} already.")
    para.append(f'"Good day, friend {y}," said the {x}. "How fine you look today!"')
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.35:
            para.append(f'"Why do you praise me?" asked the {y}. "You want something from me."')
        elif kind < 0.7:
            para.append(f"The {y} {rng.choice(VERBS_PAST)}, and the {x} {rng.choice(VERBS_PAST)}.")
        else:
            para.append(f'"If you give me {want}," said the {x}, "I will tell every animal '
                        f'{place} that you are the {rng.choice(SUPERLATIVES)} of all."')
    if rng.random() < 0.5:
        para.append(f"But the {y} was {ay}, and kept {want} for itself, and the {x} went home "
                    "with nothing.")
    else:
        para.append(f"So the {y} shared {want} with the {x}, and the two of them sat {place} "
                    "until the sun went down.")
    lines.append(textwrap.fill(" ".join(para), width=78))
    lines.append("")
    lines.append("Moral: " + rng.choice(SAYINGS))
    lines.append("")
    lines.append("")
    return "\n".join(lines)


def generate(target_bytes: int = 120_000, seed: int = 1234) -> str:
    rng = random.Random(seed)
    parts = ["A BOOK OF SMALL FABLES\n\nWritten for the torchtpu examples and dedicated to the "
             "public domain.\n\n\n"]
    n = 1
    while sum(len(p) for p in parts) < target_bytes:
        parts.append(fable(rng, n))
        n += 1
    return "".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bytes", type=int, default=120_000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=str(pathlib.Path(__file__).with_name("fables.txt")))
    args = p.parse_args()
    text = generate(args.bytes, args.seed)
    pathlib.Path(args.out).write_text(text, encoding="ascii")
    print(f"wrote {len(text)} characters to {args.out}")


if __name__ == "__main__":
    main()
