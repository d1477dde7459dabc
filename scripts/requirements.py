"""Print the project's requirements from pyproject.toml (the only place they are listed), one per line.

    python scripts/requirements.py torch   # the torch pin alone: installed first (unpinned, pip pulls GBs of CUDA)
    python scripts/requirements.py rest    # everything else the installed project needs, with its build backend
    python scripts/requirements.py rest megatron dali   # ... and the requirements of these optional extras

Container builds (services/reinforce/core/Dockerfile, scripts/build-images.sh) install from these lists.
Needs Python 3.11+ and nothing else (tomllib).
"""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())


def is_torch(requirement: str) -> bool:
    return re.match(r"[A-Za-z0-9._-]+", requirement)[0] == "torch"


def main(which: str, extras: list[str]) -> None:
    dependencies = project["project"]["dependencies"]
    optional = project["project"]["optional-dependencies"]
    if unknown := [e for e in extras if e not in optional]:
        raise SystemExit(f"unknown extras {unknown}; pyproject.toml has {sorted(optional)}")
    if which == "torch" and not extras:
        chosen = [r for r in dependencies if is_torch(r)]
    elif which == "rest":
        chosen = [r for r in dependencies if not is_torch(r)] + project["build-system"]["requires"]
        chosen += [r for e in extras for r in optional[e]]
    else:
        raise SystemExit(f"usage: {sys.argv[0]} torch | rest [EXTRA...]")
    print("\n".join(chosen))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "", sys.argv[2:])
