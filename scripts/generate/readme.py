"""The README's architecture picture, docs/assets/architecture.svg, drawn from the description below (no network,
no drawing tool): each service a box, each arrow what crosses between two of them. The docs' home page shows it too.

The reference tables that the README once held are generated into the documentation site (generate/docs.py).
"""

from pathlib import Path
from typing import NamedTuple
from xml.sax.saxutils import escape

SVG = Path(__file__).resolve().parents[2] / "docs" / "assets" / "architecture.svg"


class Box(NamedTuple):
    title: str
    detail: str
    x: int
    y: int
    w: int = 200
    h: int = 64

    @property
    def centre(self) -> tuple[float, float]:
        return self.x + self.w / 2, self.y + self.h / 2


class Arrow(NamedTuple):
    source: str
    target: str
    label: str
    bend: int = 0  # the label's offset across the arrow, to keep two labels apart


# The services and what they exchange (services/reinforce/*; concepts page of the docs).
BOXES = {
    "trainer": Box("trainer", "torch or Megatron-core, AdamW, checkpoints", 20, 168, 260),
    "critic": Box("critic (PPO only)", "value model, its own AdamW", 20, 318, 260),
    "prompts": Box("prompts stream", "Redis Streams, consumer group", 380, 28, 220),
    "reconciler": Box("weight reconciler", "supervisor locally, operator on K8s", 380, 168, 220),
    "rollouts": Box("rollouts stream", "RolloutGroup records (protobuf)", 380, 318, 220),
    "generator": Box("generator × N", "torch, vLLM or TensorRT-LLM", 730, 168),
    "reward": Box("reward server", "Triton: VADER, classifier, module:function", 1040, 48, 270),
    "environment": Box("environment service", "tools for multi-turn episodes", 1040, 298, 270),
}
ARROWS = [
    Arrow("trainer", "prompts", "XADD prompts (version v)", -14),
    Arrow("prompts", "generator", "XREADGROUP", -14),
    Arrow("generator", "reward", "score responses", -14),
    Arrow("generator", "environment", "tool calls", 16),
    Arrow("generator", "rollouts", "XADD group, then XACK prompt", 16),
    Arrow("rollouts", "trainer", "XREADGROUP", 16),
    Arrow("trainer", "reconciler", "publish v+1", -10),
    Arrow("reconciler", "generator", "POST /v1/weights", -10),
    Arrow("trainer", "critic", "values, train", 0),
]
WIDTH, HEIGHT = 1330, 400


def edge_point(box: Box, towards: tuple[float, float]) -> tuple[float, float]:
    """Where the line from the box's centre towards a point leaves the box."""
    (cx, cy), (tx, ty) = box.centre, towards
    dx, dy = tx - cx, ty - cy
    scale = min(box.w / 2 / abs(dx) if dx else float("inf"), box.h / 2 / abs(dy) if dy else float("inf"))
    return cx + dx * scale, cy + dy * scale


def box_svg(box: Box) -> str:
    cx = box.x + box.w / 2
    return (
        f'<rect x="{box.x}" y="{box.y}" width="{box.w}" height="{box.h}" rx="8" class="box"/>'
        f'<text x="{cx}" y="{box.y + 27}" class="title">{escape(box.title)}</text>'
        f'<text x="{cx}" y="{box.y + 48}" class="detail">{escape(box.detail)}</text>'
    )


def arrow_svg(arrow: Arrow) -> str:
    source, target = BOXES[arrow.source], BOXES[arrow.target]
    x1, y1 = edge_point(source, target.centre)
    x2, y2 = edge_point(target, source.centre)
    lx, ly = (x1 + x2) / 2, (y1 + y2) / 2 + arrow.bend
    return (
        f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" marker-end="url(#head)"/>'
        f'<text x="{lx:.1f}" y="{ly:.1f}" class="label">{escape(arrow.label)}</text>'
    )


STYLE = (
    "rect.box{fill:#eef1fb;stroke:#3f51b5;stroke-width:1.5}"
    "text{font-family:Helvetica,Arial,sans-serif;text-anchor:middle;fill:#1a1a2e}"
    ".title{font-size:16px;font-weight:bold}.detail{font-size:12px}"
    ".label{font-size:12px;fill:#3f51b5;paint-order:stroke;stroke:#fff;stroke-width:4px}"
    "line{stroke:#3f51b5;stroke-width:1.5}"
)


def architecture_svg() -> str:
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="reinforce architecture">',
        f"<style>{STYLE}</style>",
        '<defs><marker id="head" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="8" markerHeight="8" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#3f51b5"/></marker></defs>',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>',
        *(arrow_svg(a) for a in ARROWS),
        *(box_svg(b) for b in BOXES.values()),
        "</svg>",
    ]
    return "\n".join(parts) + "\n"


def generated_files() -> dict[Path, str]:
    return {SVG: architecture_svg()}
