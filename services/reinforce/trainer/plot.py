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
# Validation curves drawn on the panel of their training counterpart (rows of evaluation steps only).
VALIDATION_OF = {"train_rollouts/rewards": "val/rewards", "train_rollouts/init_policy_kl": "val/init_policy_kl"}


def plot_metrics(jsonl_path: Path, png_path: Path) -> None:
    rows = read_metrics(jsonl_path)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2), constrained_layout=True)
    for ax, (name, title) in zip(axes, PANELS, strict=True):
        train = [r for r in rows if r.get(name) is not None]
        ax.plot([r[STEP] for r in train], [r[name] for r in train], marker=".", label="train")
        val_name = VALIDATION_OF.get(name)
        val = [r for r in rows if val_name and r.get(val_name) is not None]
        if val:
            ax.plot([r[STEP] for r in val], [r[val_name] for r in val], marker="o", label="validation")
            ax.legend(fontsize="small")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
