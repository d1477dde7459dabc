"""The tiny example's reward with the fault campaign's reward faults (tests/campaign.py): while the faults file
counts `raise` calls still to fail the reward function raises, while it counts `nan` calls it answers NaN; each such
call counts one down. A `module:function` reward, so that the real reward server runs it; with nothing counted it
scores as `reinforce.reward.rewards:char_fraction` does."""

from __future__ import annotations

import json
import math
from pathlib import Path

from reinforce.reward.rewards import char_fraction


def char_fraction_with_faults(prompts: list[str], responses: list[str], char: str, faults_file: str) -> list[float]:
    path = Path(faults_file)
    counts = json.loads(path.read_text()) if path.is_file() else {}
    fault = next((name for name in ("raise", "nan") if counts.get(name, 0) > 0), None)
    if fault is not None:
        write_counts(path, {**counts, fault: counts[fault] - 1})
    if fault == "raise":
        raise RuntimeError("the reward backend is down (a fault the campaign threw)")
    rewards = char_fraction(prompts, responses, char)
    return [math.nan] * len(rewards) if fault == "nan" else rewards


def write_counts(path: Path, counts: dict[str, int]) -> None:
    """Whole or not at all: the campaign and the reward server both write it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(counts))
    tmp.replace(path)
