"""Experiment trackers (`logging.trackers`): TensorBoard, Weights & Biases (offline), MLflow (a local file store).

The trainer's main rank logs every metrics.jsonl row to each, under the same names and steps, with the run spec
as the run's configuration, and each samples file (core/samples.py) as a table: TensorBoard text `samples`, a W&B
table `samples`, an MLflow artifact samples/step-NNNNNN.jsonl. Each lives in the run folder: `tensorboard/`,
`wandb/`, `mlruns/`. Each is an optional extra (`pip install 'reinforce-k8s[tensorboard]'`, `[wandb]`, `[mlflow]`,
or `[trackers]` for all three); a tracker whose package is missing is refused when the run starts, naming the
tracker and the extra.

A resumed trainer continues the same tracker run and redoes the steps after its checkpoint, so no step is
logged twice: TensorBoard purges the events after the checkpoint's step (its `purge_step`), MLflow's file store
drops them from its metric files, and W&B (whose offline runs cannot be rewound) is given a row only once the
checkpoint that covers it is written (and every row at the end of the run).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
from pathlib import Path
from typing import Any

from reinforce.core.optional import require_package
from reinforce.core.run_dir import RunPaths
from reinforce.core.samples import SAMPLE_KEYS, read_samples, samples_jsonl

# tracker -> (module that must be importable, pip extra)
TRACKER_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


def check_trackers(names: list[str]) -> None:
    """Refuse a tracker whose package is missing, naming it and the pip extra that brings it."""
    for name in names:
        module, extra = TRACKER_PACKAGES[name]
        require_package(module, f"logging.trackers: tracker {name!r}", f"pip install 'reinforce-k8s[{extra}]'")


def tracker_run_id(run_dir: Path, name: str) -> str:
    """A stable id of the run's tracker run: the same for every life of the trainer."""
    return hashlib.sha256(f"{run_dir.resolve()}:{name}".encode()).hexdigest()[:16]


class Tracker:
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A step's samples table (core/samples.py's rows)."""

    def durable(self, step: int) -> None:
        """Rows through `step` will never be redone (a checkpoint covers them, or the run ended)."""

    def close(self) -> None: ...


class TensorBoardTracker(Tracker):
    def __init__(self, folder: Path, config: dict, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard drops the events of earlier lives from this step on (the steps redone now). Also
        # on the first life: its session-start event is what TensorBoard's own reader needs to take a later life's
        # for a restart (without it the first restart purges nothing there and every redone step shows twice).
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=resume_step + 1)
        if not resume_step:
            self.writer.add_text("spec", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text("samples", _markdown_table(rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """Offline: `wandb sync RUN_DIR/wandb/offline-run-*` uploads it (the lives of a resumed run share one id).

    W&B's offline run file is written by its own service process, which a killed trainer takes down with whatever
    it had not written yet. So a resumed trainer reads the earlier lives' run files (W&B's transaction log), finds
    the last step they hold, and first logs metrics.jsonl's rows (and samples files) after it, through the
    checkpoint's step.
    """

    def __init__(self, folder: Path, config: dict, project: str, name: str, run_id: str,
                 earlier_rows: list[dict]) -> None:  # fmt: skip
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        last_written = max((step for step, _ in wandb_history_steps(folder)), default=-1)
        self.run = wandb.init(
            project=project,
            name=name,
            id=run_id,
            dir=str(folder.parent),
            mode="offline",
            config=config,
            resume="allow",
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.pending: list[tuple[int, dict[str, Any]]] = []
        paths = RunPaths(folder.parent)
        for row in earlier_rows:
            if row["step"] > last_written:
                if paths.samples_file(row["step"]).exists():
                    self.run.log({"samples": _wandb_table(read_samples(paths, row["step"]))}, step=row["step"])
                values = {k: v for k, v in row.items() if k not in ("step", "time") and _finite(v)}
                self.run.log(values, step=row["step"])

    def log(self, step: int, values: dict[str, float]) -> None:
        self.pending.append((step, values))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.pending.append((step, {"samples": _wandb_table(rows)}))  # like a metrics row: once the step is durable

    def durable(self, step: int) -> None:
        while self.pending and self.pending[0][0] <= step:
            row_step, values = self.pending.pop(0)
            self.run.log(values, step=row_step)

    def close(self) -> None:
        self.run.finish()


def _wandb_table(rows: list[dict[str, Any]]) -> Any:  # a wandb.Table
    import wandb

    return wandb.Table(columns=list(SAMPLE_KEYS), data=[[row[k] for k in SAMPLE_KEYS] for row in rows])


def wandb_history(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric of the offline runs in `folder` as sorted (step, value) pairs."""
    out: dict[str, list[tuple[int, float]]] = {}
    for step, items in wandb_history_steps(folder):
        for key, value in items.items():
            out.setdefault(key, []).append((step, value))
    return {k: sorted(v) for k, v in out.items()}


def wandb_history_steps(folder: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, {metric: value}) of each history record in the offline run files under `folder` (W&B's transaction
    log: leveldb's log format of `wandb_internal_pb2.Record`s); a torn last record is ignored."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(folder.glob("offline-run-*/run-*.wandb")):
        for data in _leveldb_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(data)
            except Exception:
                continue
            if record.WhichOneof("record_type") != "history":
                continue
            items = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    items[key] = json.loads(item.value_json)
            rows.append((record.history.step.num, items))
    return rows


def _leveldb_records(raw: bytes, header: int = 7, block: int = 32 * 1024) -> list[bytes]:
    records, pending, offset = [], b"", header
    while offset + 7 <= len(raw):
        left_in_block = block - offset % block
        if left_in_block < 7:  # a block's tail too short for a record header is padding
            offset += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[offset : offset + 7])
        if offset + 7 + length > len(raw) or (kind == 0 and length == 0):
            break
        data = raw[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == 1:  # FULL
            records.append(data)
        elif kind == 2:  # FIRST
            pending = data
        elif kind == 3:  # MIDDLE
            pending += data
        elif kind == 4:  # LAST
            records.append(pending + data)
            pending = b""
    return records


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


class MlflowTracker(Tracker):
    def __init__(self, folder: Path, config: dict, experiment: str, name: str, resume_step: int) -> None:
        # MLflow 3 keeps its file store in maintenance mode behind this switch; a folder in the run folder is what
        # a run that must not need a server wants (`mlflow ui --backend-store-uri RUN_DIR/mlruns` reads it).
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.folder = folder
        self.client = MlflowClient(tracking_uri=folder.resolve().as_uri())
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        id_file = folder / "reinforce_run_id"
        if id_file.exists():  # a resumed trainer continues its run
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            self._drop_steps_after(experiment_id, resume_step)
        else:
            run = self.client.create_run(experiment_id, run_name=name)
            self.run_id = run.info.run_id
            id_file.write_text(self.run_id)
            for key, value in _flatten(config).items():
                self.client.log_param(self.run_id, key, str(value)[:500])
            self.client.log_text(self.run_id, json.dumps(config, indent=2), "spec.json")

    def _drop_steps_after(self, experiment_id: str, step: int) -> None:
        """The file store keeps one file per metric, lines `timestamp value step`: the redone steps go."""
        metrics = self.folder / experiment_id / self.run_id / "metrics"
        for path in metrics.rglob("*") if metrics.exists() else []:
            if path.is_file():
                lines = path.read_text().splitlines()
                path.write_text("".join(line + "\n" for line in lines if int(line.split()[2]) <= step))

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        # an artifact per step: a redone step replaces its earlier life's
        self.client.log_text(self.run_id, samples_jsonl(rows), f"samples/step-{step:06d}.jsonl")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackers:
    """Every configured tracker; log() gets each metrics.jsonl row (non-finite values left out)."""

    def __init__(self, names: list[str], run_dir: Path, config: dict, run_name: str, project: str | None,
                 resume_step: int, earlier_rows: list[dict] | None = None) -> None:  # fmt: skip
        """earlier_rows: metrics.jsonl's rows through resume_step (a resumed run), for trackers that lost some."""
        check_trackers(names)
        project = project or run_name
        self.trackers: list[Tracker] = []
        for name in names:
            if name == "tensorboard":
                self.trackers.append(TensorBoardTracker(run_dir / "tensorboard", config, resume_step))
            elif name == "wandb":
                run_id = tracker_run_id(run_dir, "wandb")
                rows = earlier_rows or []
                self.trackers.append(WandbTracker(run_dir / "wandb", config, project, run_name, run_id, rows))
            elif name == "mlflow":
                (run_dir / "mlruns").mkdir(parents=True, exist_ok=True)
                self.trackers.append(MlflowTracker(run_dir / "mlruns", config, project, run_name, resume_step))

    def log(self, step: int, values: dict[str, float]) -> None:
        finite = {k: float(v) for k, v in values.items() if _finite(v)}
        for tracker in self.trackers:
            tracker.log(step, finite)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        for tracker in self.trackers:
            tracker.log_samples(step, rows)

    def durable(self, step: int) -> None:
        for tracker in self.trackers:
            tracker.durable(step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    """TensorBoard renders its text as Markdown: a table, with | and newlines escaped in the cells."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(SAMPLE_KEYS) + " |", "|" + " --- |" * len(SAMPLE_KEYS)]
    lines += ["| " + " | ".join(cell(row[k]) for k in SAMPLE_KEYS) + " |" for row in rows]
    return "\n".join(lines)


def _flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(config, dict):
        out: dict[str, Any] = {}
        for key, value in config.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): config}
