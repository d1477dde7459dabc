"""Checkpoint write, size and load for a policy folder (default: the quickstart run's initial policy).

    python benchmarks/checkpoint.py [MODEL_DIR]

Prints the time to write a full trainer checkpoint (weights, AdamW state after one step, scheduler, RNG),
its size on disk, the time to load it back, and the time to publish one weight version (safetensors +
sha256) next to a plain copy of the same bytes.
"""

import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from reinforce.core.spec import TrainingSpec
from reinforce.core.weights import publish
from reinforce.trainer.backends.torch_backend import TorchBackend
from reinforce.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from reinforce.trainer.distributed import Ranks


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    model_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/quickstart/initial_policy")
    backend = TorchBackend(TrainingSpec(), model_dir, Ranks())
    model = backend.policy
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    backend.optimizer_step()  # AdamW's moment buffers exist only after a step
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        state = TrainerState(step=1, cursor={}, weight_version=1)
        path, write_s = timed(lambda: save_checkpoint(root / "ckpt", state, backend, keep=1))
        size = folder_size(path)
        _, load_s = timed(lambda: load_checkpoint(path, backend))
        weights, publish_s = timed(lambda: publish(model, root / "weights", 1))
        _, copy_s = timed(lambda: shutil.copyfile(weights.uri, root / "copy.safetensors"))
    mb = 1e6
    print(f"model {model_dir}: {params / 1e6:.1f}M parameters")
    print(f"checkpoint write  {write_s:6.2f} s   size {size / mb:7.1f} MB   ({size / mb / write_s:.0f} MB/s)")
    print(f"checkpoint load   {load_s:6.2f} s")
    print(f"weight publish    {publish_s:6.2f} s   size {weights.num_bytes / mb:7.1f} MB (safetensors + sha256)")
    print(f"plain file copy   {copy_s:6.2f} s   same bytes: publish/copy = {publish_s / copy_s:.1f}x")


if __name__ == "__main__":
    main()
