"""The run's PNG plot: reward and KL against step."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: services and CI are headless
import matplotlib.pyplot as plt

from reinforce.core.metrics import STEP, read_metrics

PANELS = (
    ("train_rollouts/rewards", "reward"),
    ("train_rollouts/rewards_with_kl", "reward - beta * KL"),
    ("train_rollouts/init_policy_kl", "KL to reference"),
)


def plot_metrics(jsonl_path: Path, png_path: Path) -> None:
    rows = read_metrics(jsonl_path)
    steps = [r[STEP] for r in rows]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2), constrained_layout=True)
    for ax, (name, title) in zip(axes, PANELS, strict=True):
        ax.plot(steps, [r.get(name) for r in rows], marker=".")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
