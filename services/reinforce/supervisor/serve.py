"""`reinforce serve SPEC.yaml`: the Tinker training API on this machine, under the same supervision as a run.

Redis (its append-only file in RUN_DIR/redis, so that accepted requests and their futures outlive a restart of
anything, `reinforce serve` itself included), then the training API (services/reinforce/training_api/, which holds
the base model and trains each tenant's adapter in its own process for now). A child that exits is restarted with
the spec's `restart` policy; Ctrl-C or SIGTERM stops both. The API key is drawn once, kept private in
RUN_DIR/training_api/api_key and printed with the URL as the SDK reads them (TINKER_BASE_URL, TINKER_API_KEY).
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from pathlib import Path

from reinforce.core import launch
from reinforce.core.launch_flags import TrainingApiFlags
from reinforce.core.names import (
    COMPONENT_TRAINING_API,
    LOCAL_HOST,
    TRAINING_API_KEY_ENV,
    TRAINING_API_KEY_PREFIX,
    TRAINING_API_SESSION_TIMEOUT_S,
)
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import RunSpec, dump_spec, load_spec
from reinforce.supervisor.children import Children
from reinforce.supervisor.component import RunFailed
from reinforce.supervisor.lock import RunFolderBusy, RunLock
from reinforce.supervisor.main import StopSignals, resolve_spec
from reinforce.supervisor.ports import free_port


def api_key(paths: RunPaths) -> str:
    """The folder's API key: drawn on the first `serve`, the same on every later one (clients keep working)."""
    path = paths.training_api / "api_key"
    if not path.is_file():
        paths.training_api.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(TRAINING_API_KEY_PREFIX + secrets.token_urlsafe(24))
    return path.read_text().strip()


def serve(spec: RunSpec, port: int, session_timeout_s: float = TRAINING_API_SESSION_TIMEOUT_S) -> int:
    paths = RunPaths(spec.resolved_run_dir())
    paths.root.mkdir(parents=True, exist_ok=True)
    try:
        _lock = RunLock(paths.lock)  # held until exit: one supervisor per folder, a run's or a server's
    except RunFolderBusy as err:
        raise RunFailed(str(err)) from None
    paths.spec.write_text(dump_spec(spec))
    children = Children(spec)
    signals = StopSignals()
    try:
        key = children.credentials[TRAINING_API_KEY_ENV] = api_key(paths)
        children.start_redis()
        url = f"http://{LOCAL_HOST}:{port}"
        flags = TrainingApiFlags(port=port, session_timeout_s=session_timeout_s)
        argv = children.service_argv(launch.TRAINING_API, flags)
        api = children.component(COMPONENT_TRAINING_API, argv, service=launch.TRAINING_API)
        print(f"starting the training API (log: {api.log_path}) ...", flush=True)
        children.starting.append((api, url + launch.TRAINING_API.ready_path))
        children.wait_until_ready()
        print(f"export TINKER_BASE_URL={url}\nexport TINKER_API_KEY={key}", flush=True)
        while True:
            for c in children.components:
                c.supervise(spec.restart, children.env)
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("interrupted: stopping the training API and Redis", file=sys.stderr)
        return 130
    finally:
        signals.stopping = True  # a second Ctrl-C must not leave Redis or the API running
        children.stop()


def serve_command(args: argparse.Namespace) -> int:
    """`reinforce serve`: 130 after Ctrl-C, 1 when a child failed past its restarts (or never became ready)."""
    spec_file = Path(args.spec)
    spec = resolve_spec(load_spec(spec_file), spec_file)
    if args.run_dir:
        spec = spec.model_copy(update={"run_dir": str(Path(args.run_dir).resolve())})
    try:
        return serve(spec, args.port or free_port(), args.session_timeout_s)
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def add_serve_command(commands: argparse._SubParsersAction) -> None:
    command = commands.add_parser("serve", help="serve the Tinker training API locally")
    command.add_argument("spec", help="run spec YAML: its policy is the base model, its run_dir the server's folder")
    command.add_argument("--port", type=int, default=0, help="the API's port (default: a free one)")
    command.add_argument("--run-dir", metavar="DIR", help="the server's folder (instead of the spec's run_dir)")
    command.add_argument(
        "--session-timeout-s", type=float, default=TRAINING_API_SESSION_TIMEOUT_S, metavar="S",
        help="seconds a session may go without a heartbeat before it expires, its models saved and unloaded",
    )  # fmt: skip
    command.set_defaults(handler=serve_command)
