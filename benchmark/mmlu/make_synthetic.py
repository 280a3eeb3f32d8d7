"""Write a synthetic MMLU-format set (arithmetic questions) for machines without the real data.

    python benchmark/mmlu/make_synthetic.py --out data_synthetic --num-test 100

Hendrycks layout: dev/{subject}_dev.csv and test/{subject}_test.csv, no header, columns
question, A, B, C, D, answer letter. Subjects: addition, subtraction, multiplication of
small numbers; three wrong options near the right one; the right letter is uniform. This is
not MMLU: its figures are labelled as this set's, never as MMLU accuracy.
"""

from __future__ import annotations

import argparse
import csv
import os
import random

SUBJECTS = {
    "addition": ("+", lambda a, b: a + b),
    "subtraction": ("-", lambda a, b: a - b),
    "multiplication": ("*", lambda a, b: a * b),
}


def question(op: str, fn, rng: random.Random) -> list[str]:
    a, b = rng.randint(2, 49), rng.randint(2, 19)
    right = fn(a, b)
    wrong = rng.sample([right + d for d in (-10, -2, -1, 1, 2, 10)], 3)
    options = wrong[:]
    slot = rng.randrange(4)
    options.insert(slot, right)
    return [f"What is {a} {op} {b}?", *map(str, options), "ABCD"[slot]]


def write(out: str, num_dev: int, num_test: int, seed: int) -> str:
    rng = random.Random(seed)
    for split, count in (("dev", num_dev), ("test", num_test)):
        os.makedirs(os.path.join(out, split), exist_ok=True)
        for subject, (op, fn) in SUBJECTS.items():
            with open(os.path.join(out, split, f"{subject}_{split}.csv"), "w", newline="") as f:
                csv.writer(f).writerows(question(op, fn, rng) for _ in range(count))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--num-dev", type=int, default=5)
    p.add_argument("--num-test", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(write(args.out, args.num_dev, args.num_test, args.seed))


if __name__ == "__main__":
    main()
