"""Install what pip's dependency list cannot express, as declared in pyproject.toml [tool.reinforce.install]."""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

config = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["tool"]["reinforce"]["install"]


def apt_installed(package: str) -> bool:
    status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return status.stdout.endswith("installed")


apt = [pkg for pkg in config["apt"] if not apt_installed(pkg)]
if apt:
    sudo = [] if shutil.which("sudo") is None else ["sudo"]
    subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True)
    subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", *apt], check=True)
subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *config["pip-no-deps"]], check=True)
