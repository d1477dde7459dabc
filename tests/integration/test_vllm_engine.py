"""The vLLM engine keeps the torch engine's guarantees: log-probs the trainer recomputes, seeded samples that do not
depend on the batch, stop strings and EOS ending a response, and in-place refits equal to a fresh start; with
training.lora the same for adapter-only weight versions, loaded as vLLM LoRA adapters.

Skipped without vLLM (`make install` installs it). A peaked random tiny Llama (head size 32: the smallest vLLM's CPU
attention runs) keeps each test to a few seconds.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from reinforce.core.hardware import bfloat16_is_native
from reinforce.core.policy import load_policy, load_tokenizer
from reinforce.core.spec import GenerationSpec, LoraSpec, TrainingSpec
from reinforce.core.weights import publish
from reinforce.trainer.backends.torch_backend import TorchBackend
from reinforce.trainer.distributed import Ranks
from reinforce.trainer.logprobs import response_logprobs

pytest.importorskip("vllm", reason="vLLM is not installed (`make install` installs its CPU build)")

from reinforce.generator.engines.base import SampledSequence
from reinforce.generator.engines.vllm_engine import (
    CPU_NORMS,
    RELOAD_LOGGER,
    WEIGHT_DTYPE_LOGGER,
    ExpectedLoadWarnings,
    VLLMEngine,
)

PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 20, 21, 22, 23]]
SEEDS = [11, 12, 13]
K = 4
# bf16 weights against the trainer's fp32 recomputation, measured on this model: mean 0.0025, max 0.027 nats. On a
# CPU without bfloat16 hardware vLLM's kernels round float32 to bfloat16 towards zero, not to nearest
# (test_norms_run_vllms_compiled_cpu_kernels), and the mismatch grows: there, with the LoRA adapters of
# test_lora_logprobs_match_the_trainers_recomputation, mean 0.011 and max 0.058 nats.
BF16_MEAN_TOL, BF16_MAX_TOL = (0.01, 0.1) if bfloat16_is_native() else (0.02, 0.1)
FP32_TOL = 1e-4  # measured: 1e-6


@pytest.fixture(scope="module")
def policy(tiny_head32_policy: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny policy with its final norm scaled up: peaked distributions, so responses have structure."""
    folder = tmp_path_factory.mktemp("peaked") / "policy"
    shutil.copytree(tiny_head32_policy, folder)
    model = load_policy(tiny_head32_policy)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def start() -> Iterator[Callable[..., VLLMEngine]]:
    """Starts engines that live until the module's tests are done: releasing a vLLM engine tears down vLLM's
    process-wide distributed state, which the other live engines use."""
    started: list[VLLMEngine] = []

    def start_engine(folder: Path, generation: GenerationSpec, lora: LoraSpec | None = None) -> VLLMEngine:
        started.append(VLLMEngine(folder, generation, K, threads=2, lora=lora))
        return started[-1]

    yield start_engine


@pytest.fixture(scope="module")
def engine(start: Callable[..., VLLMEngine], policy: Path) -> VLLMEngine:
    return start(policy, vllm(max_new_tokens=24))


def vllm(**fields: object) -> GenerationSpec:
    """A vLLM engine's spec, in bfloat16 unless `fields` name a dtype: the bounds above are bfloat16's, whatever
    dtype auto would pick on this machine (core/hardware.py)."""
    return GenerationSpec(engine="vllm", **{"dtype": "bfloat16", **fields})


def _mismatch(policy: Path | torch.nn.Module, sampled: list[list[SampledSequence]], temperature: float) -> torch.Tensor:
    """|engine log-prob - trainer fp32 recomputation| of every sampled token (policy: its folder, or the model)."""
    model = load_policy(policy) if isinstance(policy, Path) else policy
    pairs = [(p, s) for p, group in zip(PROMPTS, sampled, strict=True) for s in group]
    with torch.no_grad():
        trainer, mask = response_logprobs(model, [p for p, _ in pairs], [s.token_ids for _, s in pairs], temperature)
    recorded = torch.zeros_like(trainer)
    for row, (_, s) in enumerate(pairs):
        recorded[row, : len(s.logprobs)] = torch.tensor(s.logprobs)
    return (recorded - trainer).abs()[mask.bool()]


def test_logprobs_match_the_trainers_recomputation_bf16(engine: VLLMEngine, policy: Path) -> None:
    sampled = engine.sample(PROMPTS, SEEDS)
    assert [len(group) for group in sampled] == [K] * len(PROMPTS)
    diff = _mismatch(policy, sampled, temperature=1.0)
    assert diff.numel() > 0
    assert diff.mean() < BF16_MEAN_TOL and diff.max() < BF16_MAX_TOL, (diff.mean(), diff.max())


def test_logprobs_are_temperature_scaled_and_unfiltered(start: Callable[..., VLLMEngine], policy: Path) -> None:
    """With top-k/top-p on, the torch engine records the unfiltered distribution: so must vLLM (fp32, tight)."""
    gen = vllm(max_new_tokens=16, temperature=1.5, top_k=2, top_p=0.9)
    sampled = start(policy, gen.model_copy(update={"dtype": "float32"})).sample(PROMPTS, SEEDS)
    # Only the two likeliest tokens can be drawn; their filtered log-probs would be far above the unfiltered ones.
    diff = _mismatch(policy, sampled, temperature=1.5)
    assert diff.max() < FP32_TOL, diff.max()


def test_same_seed_same_samples_whatever_the_batch(engine: VLLMEngine) -> None:
    alone = engine.sample([PROMPTS[1]], [SEEDS[1]])[0]
    batched = engine.sample([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]], [7, SEEDS[1], 8, 99])
    assert batched[1] == alone  # token ids and log-probs, exactly
    assert engine.sample([PROMPTS[1]], [SEEDS[1]])[0] == alone
    assert batched[3] != alone  # another seed draws other samples
    assert len({tuple(s.token_ids) for s in alone}) > 1  # the k samples of a prompt differ


def _first_with(tokens: list[int], found: Callable[[list[int]], bool]) -> int | None:
    """Length of the shortest prefix for which found(prefix) holds."""
    return next((n for n in range(1, len(tokens) + 1) if found(tokens[:n])), None)


def test_stop_string_ends_the_response_and_is_part_of_it(engine: VLLMEngine, policy: Path) -> None:
    tokenizer = load_tokenizer(policy)
    free = engine.sample(PROMPTS, SEEDS)
    text = next(s.text for group in free for s in group if len(set(s.text[2:6])) > 1)
    stop = text[2:4]  # two characters, so the stop string spans two tokens
    engine.generation = vllm(max_new_tokens=24, stop_strings=[stop])
    try:
        stopped = engine.sample(PROMPTS, SEEDS)
    finally:
        engine.generation = vllm(max_new_tokens=24)
    for free_group, stopped_group in zip(free, stopped, strict=True):
        for before, after in zip(free_group, stopped_group, strict=True):
            cut = _first_with(before.token_ids, lambda ids: stop in tokenizer.decode(ids, skip_special_tokens=True))
            if cut is None:  # no stop string: the same sample, ended by EOS or the length limit as before
                assert after == before
                continue
            assert after.token_ids == before.token_ids[:cut]  # up to and including the token completing it
            assert after.logprobs == before.logprobs[:cut]
            assert after.is_end and after.text.endswith(stop)


def test_eos_ends_the_response_and_the_length_limit_does_not(
    start: Callable[..., VLLMEngine], engine: VLLMEngine, policy: Path, tmp_path: Path
) -> None:
    free = engine.sample(PROMPTS, SEEDS)
    limited = [s for group in free for s in group if len(s.token_ids) == 24 and s.token_ids[-1] != 2]
    assert limited and not any(s.is_end for s in limited)
    # A frequent token made an EOS through the generation config, as chat models declare their end-of-turn token.
    eos = next(s.token_ids[3] for s in limited)
    folder = tmp_path / "policy"
    shutil.copytree(policy, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, eos]}))
    ended = start(folder, vllm(max_new_tokens=24)).sample(PROMPTS, SEEDS)
    for free_group, ended_group in zip(free, ended, strict=True):
        for before, after in zip(free_group, ended_group, strict=True):
            cut = _first_with(before.token_ids, lambda ids: ids[-1] in (2, eos))
            if cut is None:
                assert after == before and not after.is_end
            else:
                assert after.token_ids == before.token_ids[:cut] and after.is_end


class Collected(logging.Handler):
    """The messages a logger passed on, after its filters."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def vllm_loading_logs() -> Iterator[list[str]]:
    collected = Collected()
    loggers = [logging.getLogger(name) for name in (WEIGHT_DTYPE_LOGGER, RELOAD_LOGGER)]
    for logger in loggers:
        logger.addHandler(collected)
    try:
        yield collected.messages
    finally:
        for logger in loggers:
            logger.removeHandler(collected)


def test_refit_in_place_equals_a_fresh_engine(
    start: Callable[..., VLLMEngine], engine: VLLMEngine, policy: Path, tmp_path: Path
) -> None:
    model = load_policy(policy)
    tokenizer = load_tokenizer(policy)
    with vllm_loading_logs() as logged:
        refit_three_times(start, engine, model, tokenizer, tmp_path)
    # a bfloat16 engine on float32 files, a tied head refitted: what vLLM warns about is what the engine meant
    assert not [m for m in logged if "Failed to load weights" in m or "Attempted to load weight" in m], logged


def refit_three_times(
    start: Callable[..., VLLMEngine], engine: VLLMEngine, model: torch.nn.Module, tokenizer: object, tmp_path: Path
) -> None:
    for version in (1, 2, 3):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.02)
        # As the trainer publishes: save_model keeps only lm_head.weight of the tied embedding.
        weights = publish(model, tmp_path / "weights", version)
        engine.load_weights(Path(weights.uri))
        fresh_dir = tmp_path / f"fresh-v{version}"
        model.save_pretrained(fresh_dir)
        tokenizer.save_pretrained(fresh_dir)
        fresh = start(fresh_dir, engine.generation)
        assert engine.sample(PROMPTS, SEEDS) == fresh.sample(PROMPTS, SEEDS), f"version {version}"


def test_norms_run_vllms_compiled_cpu_kernels(engine: VLLMEngine) -> None:
    """The engine's RMSNorms dispatch to vLLM's compiled CPU kernels, which agree with vLLM's own formula up to
    bfloat16 rounding; a strided input falls back to that formula. The kernels' residual sum is the float32 sum
    rounded to nearest where the CPU has bfloat16 hardware, as torch rounds, and truncated towards zero elsewhere."""
    from vllm import ir

    for op in (ir.ops.rms_norm, ir.ops.fused_add_rms_norm):
        assert op.get_priority() == [CPU_NORMS, "native"]
    generator = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(shape, generator=generator) for shape in ((5, 64), (5, 64), (64,)))
    x, residual, weight = x.bfloat16(), residual.bfloat16(), weight.bfloat16()
    fused = ir.ops.fused_add_rms_norm
    out, total = fused.impls[CPU_NORMS].impl_fn(x.clone(), residual.clone(), weight, 1e-5)
    want_out, want_total = fused.impls["native"].impl_fn(x, residual, weight, 1e-5)
    if bfloat16_is_native("cpu"):
        torch.testing.assert_close(total, want_total, rtol=0, atol=0)
    else:
        exact = (x.float() + residual.float()).view(torch.int32)
        torch.testing.assert_close(total, (exact & ~0xFFFF).view(torch.float32).bfloat16(), rtol=0, atol=0)
        assert not torch.equal(total, want_total)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)
    single = ir.ops.rms_norm.impls
    torch.testing.assert_close(single[CPU_NORMS].impl_fn(x, weight, 1e-5), single["native"].impl_fn(x, weight, 1e-5),
                               rtol=2e-2, atol=2e-2)  # fmt: skip
    assert not single[CPU_NORMS].supports_args(x.t(), weight, 1e-5)


def test_only_the_loading_warnings_the_engine_means_are_dropped() -> None:
    quiet = ExpectedLoadWarnings(narrowed_to=torch.bfloat16, weightless=frozenset({"RotaryEmbedding"}))

    def passes(msg: str, *args: object) -> bool:
        return quiet.filter(logging.LogRecord("vllm", logging.WARNING, __file__, 1, msg, args, None))

    narrowed = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
    assert not passes(narrowed, "embed_tokens.weight", torch.float32, torch.bfloat16)
    assert passes(narrowed, "embed_tokens.weight", torch.float16, torch.bfloat16)
    assert not passes("%s: Failed to load weights", "RotaryEmbedding")
    assert passes("%s: Failed to load weights", "ParallelLMHead")  # an untied head has weights of its own to load
    assert passes("Reloading weights inplace...")


def test_a_file_that_does_not_fit_is_refused_and_the_old_weights_keep_serving(
    engine: VLLMEngine, tmp_path: Path
) -> None:
    before = engine.sample(PROMPTS, SEEDS)
    bad = tmp_path / "bad.safetensors"
    from safetensors.torch import save_file

    save_file({"lm_head.weight": torch.zeros(35, 32), "model.norm.weight": torch.ones(7)}, str(bad))
    with pytest.raises(ValueError, match="does not fit the policy"):
        engine.load_weights(bad)
    assert engine.sample(PROMPTS, SEEDS) == before


def test_head_sizes_vllm_cannot_run_are_refused_at_start(tmp_path: Path) -> None:
    from reinforce.core.policy import materialize_policy
    from reinforce.core.spec import PolicySpec, RandomInit

    folder = materialize_policy(PolicySpec(random_init=RandomInit(num_heads=2)), tmp_path / "policy", seed=0)
    with pytest.raises(ValueError, match="head sizes"):
        VLLMEngine(folder, vllm(max_new_tokens=4), 1, threads=1)


def test_generation_engine_auto_knows_the_head_sizes_vllm_runs() -> None:
    """supervisor/engine_choice.py keeps vLLM's list so as not to import vLLM in every run: it must be vLLM's."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from reinforce.supervisor.engine_choice import VLLM_CPU_HEAD_SIZES

    assert list(VLLM_CPU_HEAD_SIZES) == list(CPUAttentionBackend.get_supported_head_sizes())


def test_validation_options_greedy_and_fewer_samples(engine: VLLMEngine, policy: Path) -> None:
    """Validation asks for fewer samples at temperature 0: the likeliest token each time, the same for every seed."""
    greedy = engine.sample(PROMPTS, SEEDS, num_samples=2, temperature=0.0)
    assert [len(group) for group in greedy] == [2] * len(PROMPTS)
    assert engine.sample(PROMPTS, [1, 2, 3], num_samples=2, temperature=0.0) == greedy
    for group in greedy:
        assert group[0].token_ids == group[1].token_ids
    model = load_policy(policy)
    for prompt, group in zip(PROMPTS, greedy, strict=True):
        ids = torch.tensor([prompt + group[0].token_ids[:-1]])
        with torch.no_grad():
            likeliest = model(ids).logits[0, len(prompt) - 1 :].argmax(-1).tolist()
        # bf16 may break a near-tie the other way: most tokens, not all, must be the fp32 model's argmax
        agree = sum(a == b for a, b in zip(likeliest, group[0].token_ids, strict=True))
        assert agree >= 0.8 * len(likeliest), (likeliest, group[0].token_ids)


@pytest.mark.parametrize("tool", ["calculator", "python"])
def test_a_multi_turn_episode_continues_from_token_ids_as_with_torch(
    tool: str, start: Callable[..., VLLMEngine], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """vLLM runs a multi-turn episode (generator/episodes.py) against the real environment service: each turn is a
    request from the prompt's ids and every token so far; greedily, its trajectory and mask are the torch engine's.
    The python tool's call is a fenced block with no EOS after it: the turn ends where the fence closes (two requests,
    the first stopped at the opening fence)."""
    from tests.integration.test_environment import start_server
    from tests.integration.test_multi_turn import TRAJECTORIES, fitted_policy, run_episodes

    prompt, response = TRAJECTORIES[tool]
    # head size 32: vLLM's CPU kernel
    folder = fitted_policy(tmp_path_factory.mktemp("multi-turn-vllm") / "policy", prompt, response)
    server = start_server(tmp_path_factory.mktemp("environment"))
    try:
        engine = start(folder, vllm(max_new_tokens=160, dtype="float32"))
        [from_vllm] = run_episodes(folder, server.url, max_new_tokens=160, k=1, prompt=prompt, engine=engine)
        [from_torch] = run_episodes(folder, server.url, max_new_tokens=160, k=1, prompt=prompt)
    finally:
        server.process.terminate()
        server.process.wait(10)
    assert (from_vllm.turns, from_vllm.tool_calls, from_vllm.is_end) == (2, 1, True)
    assert from_vllm.token_ids == from_torch.token_ids and from_vllm.loss_mask == from_torch.loss_mask
    assert from_vllm.logprobs == pytest.approx(from_torch.logprobs, abs=FP32_TOL)


# ---- LoRA: adapter-only weight versions ----------------------------------------------------------------------------

LORA = LoraSpec(rank=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"])  # fmt: skip


def _lora_trainer(policy: Path) -> TorchBackend:
    """The trainer's torch backend with LoRA: PEFT adapters injected into the policy, the reference the same model."""
    pytest.importorskip("peft")
    return TorchBackend(TrainingSpec(lora=LORA, precision="fp32"), policy, Ranks())


def _publish_adapters(trainer: TorchBackend, folder: Path, version: int) -> Path:
    """Move the trainer's adapters (PEFT starts B at zero) and publish them as the trainer does: adapters only."""
    with torch.no_grad():
        for name, param in trainer.policy.named_parameters():
            if ".lora_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    tensors, metadata = trainer.weights_to_publish()
    assert metadata["format"] == "lora" and all(".lora_" in name for name in tensors)
    return Path(publish(tensors, folder, version, metadata=metadata).uri)


def test_lora_logprobs_match_the_trainers_recomputation(
    start: Callable[..., VLLMEngine], policy: Path, tmp_path: Path
) -> None:
    """The engine applies the adapters (far from the base's log-probs) as the trainer's PEFT model does: float32
    within floating-point noise, bfloat16 within the bounds of the plain bf16 engine. Measured with these adapters:
    bf16 mean 0.0067, max 0.049 nats; the plain bf16 engine serving the same weights merged: mean 0.0064, max 0.021."""
    trainer = _lora_trainer(policy)
    weights = _publish_adapters(trainer, tmp_path / "weights", 1)
    for dtype, mean_tol, max_tol in (("float32", FP32_TOL, FP32_TOL), ("bfloat16", BF16_MEAN_TOL, BF16_MAX_TOL)):
        engine = start(policy, vllm(max_new_tokens=24, dtype=dtype), LORA)
        engine.load_weights(weights)
        sampled = engine.sample(PROMPTS, SEEDS)
        diff = _mismatch(trainer.policy, sampled, temperature=1.0)
        assert diff.numel() > 0
        assert diff.mean() < mean_tol and diff.max() < max_tol, (dtype, diff.mean(), diff.max())
        assert _mismatch(policy, sampled, temperature=1.0).mean() > 0.1  # the base alone would not match


def test_lora_refit_equals_a_fresh_engine_and_keeps_one_adapter(
    start: Callable[..., VLLMEngine], engine: VLLMEngine, policy: Path, tmp_path: Path
) -> None:
    """Version 0 of a LoRA engine is the base; each later version, loaded over the ones before it, samples exactly
    what a fresh engine that loaded only it samples, and vLLM holds only the current adapter."""
    lora_engine = start(policy, engine.generation, LORA)
    before = lora_engine.sample(PROMPTS, SEEDS)
    base = start(policy, engine.generation)  # not `engine`, which other tests refit
    assert before == base.sample(PROMPTS, SEEDS)  # no adapter: the base model, to the bit
    trainer = _lora_trainer(policy)
    for version in (1, 2, 3):
        weights = _publish_adapters(trainer, tmp_path / "weights", version)
        lora_engine.load_weights(weights)
        assert lora_engine._llm.llm_engine.list_loras() == {lora_engine._lora.lora_int_id}  # the old one evicted
        fresh = start(policy, engine.generation, LORA)
        fresh.load_weights(weights)
        refitted = lora_engine.sample(PROMPTS, SEEDS)
        assert refitted == fresh.sample(PROMPTS, SEEDS), f"version {version}"
        assert refitted != before, f"version {version} sampled what the version before it did"
        before = refitted
    # the same seed samples the same tokens alone and in a batch, with the adapter too
    alone = lora_engine.sample([PROMPTS[1]], [SEEDS[1]])[0]
    assert lora_engine.sample([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [7, SEEDS[1], 8])[1] == alone


def test_lora_versions_that_do_not_fit_are_refused_and_the_adapter_keeps_serving(
    start: Callable[..., VLLMEngine], engine: VLLMEngine, policy: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    lora_engine = start(policy, engine.generation, LORA)
    trainer = _lora_trainer(policy)
    lora_engine.load_weights(_publish_adapters(trainer, tmp_path / "weights", 1))
    serving = lora_engine.sample(PROMPTS, SEEDS)
    metadata = {"format": "lora", "lora_scaling": "2.0"}
    module = "model.layers.0.self_attn.q_proj"
    wrong_width = tmp_path / "wrong-width.safetensors"
    save_file({f"{module}.lora_A.weight": torch.zeros(8, 7), f"{module}.lora_B.weight": torch.zeros(32, 8)},
              str(wrong_width), metadata)  # fmt: skip
    too_wide = tmp_path / "rank-16.safetensors"  # above max_lora_rank 8 (training.lora.rank 8)
    save_file({f"{module}.lora_A.weight": torch.zeros(16, 32), f"{module}.lora_B.weight": torch.zeros(32, 16)},
              str(too_wide), metadata)  # fmt: skip
    # the red team's R4-12: numbers no trained adapter has, and a module no LoRA version adapts
    fitting = {f"{module}.lora_A.weight": torch.full((8, 32), 0.01), f"{module}.lora_B.weight": torch.ones(32, 8)}
    forged = {}
    for name, scaling, tensors in (("nan-scaling", "nan", fitting), ("huge-scaling", "1e308", fitting),
                                   ("nan-weights", "2.0", {**fitting, f"{module}.lora_B.weight": torch.full(
                                       (32, 8), float("nan"))}),
                                   ("lm-head", "2.0", {"lm_head.lora_A.weight": torch.zeros(8, 32),
                                                       "lm_head.lora_B.weight": torch.zeros(64, 8)})):  # fmt: skip
        forged[name] = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(forged[name]), {**metadata, "lora_scaling": scaling})
    for bad, message in (
        (forged["nan-scaling"], "lora_scaling nan is not a finite positive number"),
        (forged["huge-scaling"], "could reach .* past float32"),
        (forged["nan-weights"], "lora_B.weight holds non-finite values"),
        (forged["lm-head"], "an adapter of 'lm_head', none of training.lora.target_modules"),
        (wrong_width, "does not fit the policy"),
        (too_wide, "LoRA rank 16 above the engine's max_lora_rank 8"),
        (policy / "model.safetensors", "a whole-policy weight version, but the engine started with LoRA"),
    ):
        with pytest.raises(ValueError, match=message):
            lora_engine.load_weights(bad)
        assert lora_engine.sample(PROMPTS, SEEDS) == serving
    with pytest.raises(ValueError, match="a LoRA weight version, but the engine started without LoRA"):
        engine.load_weights(wrong_width)
