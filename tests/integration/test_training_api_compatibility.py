"""Every public method of the `tinker` SDK's four clients called against a served training API
(scripts/tinker_compatibility.py): each is supported, or refused at once (by the server, naming what it refuses, or by
the SDK before it sends anything), none hangs, none is left out, and docs/training-api.md's table is what they do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker", reason="the `api` extra (tinker==0.38.0) is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import tinker_compatibility as compatibility

pytestmark = pytest.mark.slow


def test_every_sdk_method_is_answered_and_the_docs_table_says_how(tmp_path: Path) -> None:
    with compatibility.served(compatibility.tiny_spec(tmp_path), tmp_path) as (url, key):
        rows = compatibility.measure(url, key)
    assert [(r.client, r.method) for r in rows] == compatibility.public_methods()
    assert not [r for r in rows if not r.answered], "hangs, or refused without naming what"
    supported = {r.method for r in rows if r.outcome == "supported"}
    assert {"forward_backward", "optim_step", "sample", "save_state", "load_state_with_optimizer"} <= supported
    assert compatibility.render(rows) == compatibility.committed_table(), "python scripts/tinker_compatibility.py"
