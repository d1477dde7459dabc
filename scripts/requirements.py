"""Print the project's requirements from pyproject.toml (the only place they are listed), one per line.

    python scripts/requirements.py torch   # the torch pin alone: installed first (unpinned, pip pulls GBs of CUDA)
    python scripts/requirements.py rest    # everything else the installed project needs, with its build backend

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


def main(which: str) -> None:
    dependencies = project["project"]["dependencies"]
    if which == "torch":
        chosen = [r for r in dependencies if is_torch(r)]
    elif which == "rest":
        chosen = [r for r in dependencies if not is_torch(r)] + project["build-system"]["requires"]
    else:
        raise SystemExit(f"usage: {sys.argv[0]} torch|rest")
    print("\n".join(chosen))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) == 2 else "")
