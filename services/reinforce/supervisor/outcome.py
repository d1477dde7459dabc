"""How the last `reinforce run` of a run folder ended (RunPaths.outcome), for `reinforce status`: a folder alone
cannot tell a run that failed from one that was interrupted."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from reinforce.core.durable import write_text_atomically
from reinforce.core.run_dir import RunPaths

log = logging.getLogger("reinforce")


@dataclass(frozen=True)
class Outcome:
    exit_code: int  # reinforce run's: 0 done, 1 a component failed, 130 interrupted
    message: str


def record_outcome(paths: RunPaths, exit_code: int, message: str) -> None:
    try:
        write_text_atomically(paths.outcome, json.dumps({"exit_code": exit_code, "message": message}) + "\n")
    except OSError as err:  # a full disk: the run's end is still printed
        log.warning("writing %s failed: %s", paths.outcome, err)


def read_outcome(paths: RunPaths) -> Outcome | None:
    """None where no run recorded its end (none ended, or the supervisor was killed)."""
    try:
        data = json.loads(paths.outcome.read_text())
        return Outcome(int(data["exit_code"]), str(data["message"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
