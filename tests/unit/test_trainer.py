"""Trainer pieces that need no running services: the LR schedule, step batches, checkpoints, weights."""

import hashlib
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from reinforce.core.checkpoints import list_checkpoints
from reinforce.core.records_pb2 import RolloutGroup, Sample, WeightVersion
from reinforce.core.spec import TrainingSpec
from reinforce.core.weights import (
    WeightError,
    WeightSources,
    load_verified,
    module_loader,
    publish,
    write_safetensors,
)
from reinforce.trainer.backends.base import lr_factor
from reinforce.trainer.backends.torch_backend import TorchBackend
from reinforce.trainer.batch import StepBatch
from reinforce.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from reinforce.trainer.distributed import Ranks
from reinforce.trainer.feed import prompt_seed


def tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_constant_schedule_with_warmup():
    t = TrainingSpec(steps=10, warmup_steps=4)
    assert [lr_factor(t, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_schedule_ends_at_min_ratio():
    t = TrainingSpec(steps=12, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(t, 2) == pytest.approx(1.0)
    assert lr_factor(t, 7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(t, 12) == pytest.approx(0.1)
    factors = [lr_factor(t, s) for s in range(2, 13)]
    assert factors == sorted(factors, reverse=True)


def test_prompt_seed_is_stable_and_distinct():
    assert prompt_seed(1, "3-0") == prompt_seed(1, "3-0")
    assert len({prompt_seed(1, f"3-{i}") for i in range(100)} | {prompt_seed(2, "3-0")}) == 101


def test_step_batch_drops_non_finite_rewards():
    group = RolloutGroup(
        prompt_id="0-0",
        samples=[
            Sample(token_ids=[1, 2], reward=1.0, is_end=True),
            Sample(token_ids=[1], reward=float("nan"), is_end=True),
            Sample(token_ids=[1, 2, 3], reward=float("inf"), is_end=False),
            Sample(token_ids=[4], reward=0.5, is_end=True),
        ],
    )
    batch = StepBatch.from_groups([group])
    assert batch.keep.tolist() == [[True, False, False, True]]
    assert batch.is_end.tolist() == [[True, False, False, True]]  # dropped samples leave the baseline
    assert torch.isfinite(batch.rewards).all()
    assert batch.num_tokens == 3


def test_weights_round_trip_and_corruption_is_refused(tmp_path):
    source, target = tiny_model(0), tiny_model(1)
    published = publish(source, tmp_path, version=5)
    assert published.version == 5 and len(published.sha256) == 64
    load_verified(module_loader(target), published, WeightSources(tmp_path))
    assert same_weights(source, target)

    before = {k: v.clone() for k, v in target.state_dict().items()}
    tampered = WeightVersion()
    tampered.CopyFrom(published)
    tampered.sha256 = "0" * 64
    with pytest.raises(WeightError, match="sha256"):
        load_verified(module_loader(target), tampered, WeightSources(tmp_path))
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_weights_publish_in_the_generators_dtype(tmp_path):
    """bfloat16 for a bfloat16 engine: half the bytes, every tensor rounded as the engine's own cast rounds it,
    the names save_model writes (a tied embedding once, as lm_head.weight), the digest of the bytes on disk."""
    source = tiny_model(0)
    full = publish(source, tmp_path / "fp32", version=1)
    half = publish(source, tmp_path / "bf16", version=1, dtype=torch.bfloat16)
    with safe_open(full.uri, "pt") as f32, safe_open(half.uri, "pt") as f16:
        assert sorted(f16.keys()) == sorted(f32.keys())
        assert "lm_head.weight" in f16.keys() and "model.embed_tokens.weight" not in f16.keys()  # noqa: SIM118
        for name in f16.keys():  # noqa: SIM118 (safe_open has no __iter__)
            assert f16.get_tensor(name).dtype == torch.bfloat16
            assert torch.equal(f16.get_tensor(name), f32.get_tensor(name).to(torch.bfloat16))
    assert half.num_bytes < 0.6 * full.num_bytes
    assert half.sha256 == hashlib.sha256(Path(half.uri).read_bytes()).hexdigest()
    target = tiny_model(1).to(torch.bfloat16)
    load_verified(module_loader(target), half, WeightSources(tmp_path / "bf16"))
    assert same_weights(source.to(torch.bfloat16), target)


def test_written_safetensors_read_back_with_the_library(tmp_path):
    tensors = {
        "w": torch.randn(3, 5),
        "half": torch.randn(7).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "ids": torch.arange(4, dtype=torch.int64),
        "flags": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
        "strided": torch.randn(4, 6)[:, ::2],  # not contiguous: written in C order
    }
    num_bytes, digest = write_safetensors(tmp_path / "t.safetensors", tensors, {"version": "3"})
    data = (tmp_path / "t.safetensors").read_bytes()
    assert num_bytes == len(data) and digest == hashlib.sha256(data).hexdigest()
    loaded = load_file(tmp_path / "t.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        assert f.metadata() == {"version": "3"}
    with pytest.raises(ValueError, match=r"c: dtype torch\.complex64"):
        write_safetensors(tmp_path / "c.safetensors", {"c": torch.zeros(2, dtype=torch.cfloat)}, {})


def test_only_recent_weight_versions_are_kept(tmp_path):
    model = tiny_model(0)
    for version in range(6):
        publish(model, tmp_path, version, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"v00000{v}.safetensors" for v in (3, 4, 5)]


def test_checkpoint_round_trip_keeps_last_k(tmp_path):
    policy_dir = tmp_path / "policy"
    tiny_model(0).save_pretrained(policy_dir)
    training = TrainingSpec(lr=1e-3, lr_schedule="cosine", steps=10)
    backend = TorchBackend(training, policy_dir, Ranks())
    for step in (1, 2, 3):
        backend.zero_grad()
        backend.policy(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
        backend.optimizer_step()
        state = TrainerState(step, {"epoch": 0, "index": step}, step)
        save_checkpoint(tmp_path / "ckpt", state, backend, keep=2, run_id="r")
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["step-000002", "step-000003"]

    restored = TorchBackend(training, policy_dir, Ranks())
    state = load_checkpoint(list_checkpoints(tmp_path / "ckpt")[-1], restored)
    assert state == TrainerState(3, {"epoch": 0, "index": 3}, 3)
    assert same_weights(backend.policy, restored.policy)
    assert not same_weights(restored.policy, restored.reference)  # the reference stays the initial policy
    assert restored.scheduler.last_epoch == backend.scheduler.last_epoch
    exp_avg = [b.optimizer.state_dict()["state"][0]["exp_avg"] for b in (backend, restored)]
    assert torch.equal(*exp_avg)


def _tiny_run(tmp_path: Path, **algorithm) -> tuple:
    """(spec, torch backend) of a one-layer random policy, k = 2, two prompts per step."""
    from reinforce.core.policy import materialize_policy
    from reinforce.core.spec import RunSpec
    from reinforce.trainer.backends import build_backend

    spec = RunSpec.model_validate(
        {
            "name": "mismatch",
            "policy": {"random_init": {"hidden_size": 16, "intermediate_size": 16, "num_layers": 1}},
            "data": {"prompts": "unused.txt"},
            "algorithm": {"num_rollouts_per_prompt": 2, **algorithm},
            "training": {"prompts_per_step": 2, "micro_batch_prompts": 2, "lr": 1e-3},
        }
    )
    materialize_policy(spec.policy, tmp_path / "policy", seed=0)
    return spec, build_backend(spec.training, tmp_path / "policy", Ranks())


RESPONSES = [[3, 4, 5], [6, 7]]


def _group(pid: str, logprobs: list[list[float]]) -> RolloutGroup:
    samples = [
        Sample(token_ids=r, logprobs=lp, reward=float(i), is_end=True)
        for i, (r, lp) in enumerate(zip(RESPONSES, logprobs, strict=True))
    ]
    return RolloutGroup(prompt_id=pid, step=0, policy_version=0, prompt_token_ids=[1, 2], samples=samples)


def _honest_and_forged(backend) -> list[RolloutGroup]:
    """A group with the backend's own log-probs, and one with what other weights (near-certain tokens) report."""
    with torch.no_grad():
        genuine, _ = backend.policy_logprobs([[1, 2]] * 2, RESPONSES, 1.0)
    honest = _group("0-0", [genuine[0, :3].tolist(), genuine[1, :2].tolist()])
    return [honest, _group("0-1", [[-0.01] * 3, [-0.01] * 2])]


def test_groups_whose_logprobs_are_not_the_trainers_are_refused_and_counted(tmp_path):
    """Issue #13, finding 1: a group 'sampled by version v' whose log-probs are far from what v gives (forged or
    corrupted weights behind it) is left out of the update and counted; a genuine group is trained on."""
    from reinforce.trainer.algorithms import build_algorithm

    spec, backend = _tiny_run(tmp_path)
    batch = StepBatch.from_groups(_honest_and_forged(backend))
    values = build_algorithm(spec, Ranks()).update(batch, backend, version=0)
    assert values["train_rollouts/refused_mismatched_groups"] == 1.0
    assert math.isfinite(values["train_optim/loss"]) and values["train_optim/loss"] != 0.0  # the honest one trained


def test_ppo_refuses_mismatched_groups_too(tmp_path):
    """Issue #30, R3-3: PPO had no refusal; a forged group's samples are now out of its rollout's kept samples."""
    from reinforce.trainer.algorithms.ppo_trainer import PPO

    spec, backend = _tiny_run(tmp_path, name="ppo")
    batch = StepBatch.from_groups(_honest_and_forged(backend))
    rollout, _, stats = PPO(spec, Ranks(), critic=None).rollout(batch, backend, version=0)
    assert stats["train_rollouts/refused_mismatched_groups"] == 1
    assert rollout.keep.tolist() == [True, True, False, False]
    assert rollout.mask[2:].sum() == 0


def test_nan_generator_logprobs_count_as_mismatched():
    """Issue #30, R3-4: `NaN > limit` is false, so NaN log-probs passed the refusal."""
    from reinforce.trainer.algorithms.reinforce import mismatched_groups

    behaviour = torch.tensor([[-1.0, math.nan], [-1.0, -1.0]])
    trainer = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    refused = mismatched_groups(behaviour, trainer, torch.ones(2, 2), torch.tensor([True, True]), k=1, limit=0.1)
    assert refused.tolist() == [True, False]


def test_a_non_finite_gradient_is_never_stepped(tmp_path):
    """Issue #30, R3-2: one NaN gradient used to make every weight NaN (then published and checkpointed)."""
    _, backend = _tiny_run(tmp_path)
    before = {k: v.clone() for k, v in backend.policy.state_dict().items()}
    for p in backend.trainable_parameters():
        p.grad = torch.ones_like(p)
    next(iter(backend.trainable_parameters())).grad[0] = math.nan
    grad_norm, _ = backend.optimizer_step()
    assert math.isnan(grad_norm) and backend.skipped_nonfinite_steps == 1
    assert all(torch.equal(before[k], v) for k, v in backend.policy.state_dict().items())
    assert backend.scheduler.last_epoch == 1  # the schedule is a function of the step, skipped or not
    for p in backend.trainable_parameters():
        p.grad = torch.ones_like(p)
    backend.optimizer_step()
    assert backend.skipped_nonfinite_steps == 1
    assert not all(torch.equal(before[k], v) for k, v in backend.policy.state_dict().items())


def test_weights_that_are_not_finite_are_never_published():
    """Issue #30, R3-2: the last line behind the skipped steps: a version holding a NaN or inf tensor is refused,
    naming it, before anything is written (so neither published nor checkpointed)."""
    from reinforce.trainer.main import _check_finite

    finite = {"a": torch.ones(2), "b": torch.zeros(3, dtype=torch.bfloat16)}
    _check_finite(finite, 5)
    _check_finite(tiny_model(0), 5)
    for bad in (math.nan, math.inf):
        with pytest.raises(
            RuntimeError, match=r"weight version 5: 1 tensors are not finite \(first: b\); not published"
        ):
            _check_finite({**finite, "b": torch.tensor([0.0, bad, 1.0])}, 5)


def test_checkpoint_files_and_folders_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    """Issue #13, finding 10: a crash right after a checkpoint is named cannot leave it empty or partial."""
    import os

    from reinforce.core import durable

    policy_dir = tmp_path / "policy"
    tiny_model(0).save_pretrained(policy_dir)
    backend = TorchBackend(TrainingSpec(lr=1e-3), policy_dir, Ranks())
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("rename", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    monkeypatch.setattr(durable.os, "replace", replace)
    final = save_checkpoint(
        tmp_path / "ckpt", TrainerState(1, {"epoch": 0, "index": 1}, 1), backend, keep=2, run_id="r"
    )
    renamed = events.index(("rename", str(final)))
    synced_before = {path for kind, path in events[:renamed] if kind == "fsync"}
    tmp = str(tmp_path / "ckpt" / ".tmp-step-000001")
    files = {f"{tmp}/{p.relative_to(final)}" for p in final.rglob("*")}
    assert files and files | {tmp} <= synced_before
    assert ("fsync", str(tmp_path / "ckpt")) in events[renamed:]  # the new name itself is durable


def test_metrics_rewrite_on_resume_is_atomic_and_appending_continues(tmp_path, monkeypatch):
    """Issue #13, finding 10: a resume drops the rows of redone steps by writing a new file and renaming it; a
    crash mid-rewrite keeps the old file whole, and the writer appends to the new file afterwards."""
    from reinforce.core import durable
    from reinforce.core.metrics import STEP_METRICS, TrainerMetrics, read_metrics
    from reinforce.trainer.main import _truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    metrics = TrainerMetrics(path)
    values = dict.fromkeys(STEP_METRICS, 0.0)
    for step in (1, 2, 3):
        metrics.record(step, values)
    before = path.read_text()

    def crash(*_args: object) -> None:
        raise OSError("power lost")

    monkeypatch.setattr(durable.os, "replace", crash)
    with pytest.raises(OSError):
        _truncate_jsonl(path, keep_through_step=1)
    assert path.read_text() == before  # nothing lost
    monkeypatch.undo()
    inode = path.stat().st_ino
    _truncate_jsonl(path, keep_through_step=1)
    assert path.stat().st_ino != inode  # a new file, renamed into place
    metrics.reopen()
    metrics.record(2, values)
    metrics.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


def _moved(backend, seed: int) -> None:
    """A version on: every weight moved by seeded noise, far enough that log-probs differ past the refusal's limit."""
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in backend.trainable_parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=noise))
    backend._refresh_compute()


def test_groups_claiming_an_earlier_version_are_checked_against_its_weights(tmp_path):
    """The red team's R4-7: asynchronous mode checked the current version's groups only, so forged groups claiming
    the previous version (log-probs of -30 a token) were trained on. A group is checked against the weights of the
    version it claims, which the backend keeps for max_policy_lag versions; one claiming a version this process
    never kept (it started since) is refused too."""
    from reinforce.trainer.algorithms import build_algorithm
    from reinforce.trainer.algorithms.reinforce import earlier_versions_mismatched

    spec, backend = _tiny_run(tmp_path, max_policy_lag=1)
    limit, temperature = spec.training.max_logprob_mismatch, 1.0
    backend.keep_version(0, oldest=-1)
    honest_v0, _ = _honest_and_forged(backend)
    forged_v0 = _group("0-1", [[-30.0] * 3, [-30.0] * 2])
    _moved(backend, seed=3)
    backend.keep_version(1, oldest=0)
    honest_v1, _ = _honest_and_forged(backend)
    honest_v1.policy_version = 1
    groups = [honest_v0, forged_v0, honest_v1]
    with torch.no_grad():
        now, _ = backend.policy_logprobs([[1, 2]] * 2, RESPONSES, temperature)
    assert earlier_versions_mismatched(groups, backend, 1, limit, temperature).tolist() == [False, True, False]
    with torch.no_grad():
        assert torch.equal(backend.policy_logprobs([[1, 2]] * 2, RESPONSES, temperature)[0], now)  # swapped back
    # version 0's log-probs claiming version 1 are refused: each claim is checked against its own version's weights
    claims_v1 = RolloutGroup()
    claims_v1.CopyFrom(honest_v0)
    claims_v1.policy_version = 1
    assert earlier_versions_mismatched([claims_v1, honest_v0], backend, 2, limit, temperature).tolist() == [True, False]
    values = build_algorithm(spec, Ranks()).update(StepBatch.from_groups(groups[:2]), backend, version=1)
    assert values["train_rollouts/refused_mismatched_groups"] == 1.0

    _, backend = _tiny_run(tmp_path / "resumed", max_policy_lag=1)
    backend.keep_version(1, oldest=0)
    assert earlier_versions_mismatched([honest_v0], backend, 1, limit, temperature).tolist() == [True]
