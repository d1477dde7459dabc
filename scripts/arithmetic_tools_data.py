"""Writes examples/data/arithmetic-tools-train.jsonl and examples/data/arithmetic-tools-validation.jsonl: 3-digit
by 3-digit multiplication, which SmolLM2-135M-Instruct cannot do in its head, for examples/arithmetic-tools.yaml.

    python scripts/arithmetic_tools_data.py

Seeded, so the files are the same on every run. Every operand pair is distinct; the validation pairs are never
trained on.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"
SEED = 24
TRAIN, VALIDATION = 128, 32
PROMPT = "Write Python code to compute {a} * {b}, then give the number."


def main() -> None:
    rng = random.Random(SEED)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < TRAIN + VALIDATION:
        pairs.add((rng.randint(100, 999), rng.randint(100, 999)))
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    for name, chunk in (("train", ordered[:TRAIN]), ("validation", ordered[TRAIN:])):
        lines = [json.dumps({"prompt": PROMPT.format(a=a, b=b), "answer": a * b}) for a, b in chunk]
        (DATA / f"arithmetic-tools-{name}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
