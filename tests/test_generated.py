"""Generated artefacts stay in step with their single source of truth."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_records_pb2_matches_the_proto(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto/reinforce/v1'}",
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", "records.proto"],
        check=True,
    )  # fmt: skip
    for name in ("records_pb2.py", "records_pb2.pyi"):
        committed = (ROOT / "services/core" / name).read_text()
        assert (tmp_path / name).read_text() == committed, f"services/core/{name} is stale: run `make proto`"


def test_readme_tables_match_the_code():
    spec = importlib.util.spec_from_file_location("update_readme", ROOT / "scripts/update_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (ROOT / "README.md").read_text()
    assert module.render(readme) == readme, "README's generated tables are stale: run scripts/update_readme.py"
