"""The typed model of a run: one source of truth for the CLI's YAML file and the ReinforceRun custom resource.

A ReinforceRun's spec is this model plus what only Kubernetes needs (operator/resource.py).

Every field has a documented default. Unknown fields, wrong types and out-of-range values are errors that
name the field path, e.g. ``training.lr: Input should be greater than 0``.

Each field has two spellings: its snake_case name (``training.num_ranks``, canonical in spec files) and its camelCase
alias (``training.numRanks``, canonical in a ReinforceRun, as the Kubernetes API conventions spell fields). Both are
accepted everywhere; an error names the field as the input spelled it. ``respell`` turns one spelling into the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel

from reinforce.core.registry import AdvantageEstimator, AlgorithmName, BackendName, EngineName


class SpecError(ValueError):
    """A run spec that cannot be used; the message names the file and every bad field path."""


# A spec is a few KB: a larger file is a mistake (or an attack) and is refused before it is parsed.
MAX_SPEC_BYTES = 1 << 20
# Nesting levels of a spec's mappings and lists (a section is 2; reward.kwargs adds the function's own few).
MAX_SPEC_DEPTH = 32


class _Section(BaseModel):
    # strict: `steps: true` is not 1 and `lr: "1e-3"` not a number (an int is still a valid float);
    # allow_inf_nan=False: `.inf` and `.nan` are no learning rate, back-off or timeout.
    # Fields are read by name or by camelCase alias (module docstring) and written by name unless asked otherwise.
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        allow_inf_nan=False,
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
    )


class RandomInit(_Section):
    """A tiny randomly initialised Llama with a character-level tokenizer (tests, `tiny.yaml`)."""

    vocab: str = Field("abcdefghijklmnopqrstuvwxyz .,!?", min_length=2, description="Characters of the tokenizer.")
    tokens: list[str] = Field(
        default_factory=list,
        description="Whole tokens besides the characters, each one token however long (a tool call in one token "
        "lets a tiny random policy find it: examples/tiny-tools.yaml).",
    )
    hidden_size: int = Field(32, ge=8, description="Model width.")
    intermediate_size: int = Field(64, ge=8, description="MLP width.")
    num_layers: int = Field(2, ge=1, description="Transformer layers.")
    num_heads: int = Field(2, ge=1, description="Attention heads (hidden_size must divide by it).")
    max_position_embeddings: int = Field(256, ge=16, description="Longest prompt + response.")
    tie_word_embeddings: bool = Field(
        True, description="Output layer shares the input embeddings' weight (False: LoRA may adapt lm_head)."
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> RandomInit:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        return self


class PolicySpec(_Section):
    """Where the initial policy comes from. Exactly one of `path` and `random_init`."""

    path: str | None = Field(
        None,
        description="Hugging Face model folder, or `package:NAME` for the folder of an installed Python package.",
    )
    gguf_file: str | None = Field(None, description="GGUF file inside `path` to load (dequantised to float32).")
    random_init: RandomInit | None = Field(None, description="Build a tiny random model instead of loading one.")

    @model_validator(mode="after")
    def _one_source(self) -> PolicySpec:
        if (self.path is None) == (self.random_init is None):
            raise ValueError("set exactly one of path and random_init")
        if self.gguf_file and self.path is None:
            raise ValueError("gguf_file needs path")
        return self


# The built-in reward that runs a response's code and the prompt's tests in the environment service's sandbox.
CODE_TESTS_REWARD = "reinforce.reward.rewards:code_tests"


class RewardSpec(_Section):
    """The reward model served by Triton as model `reward`."""

    type: Literal["vader", "hf_classifier", "python"] = Field(
        "vader",
        description="vader: VADER compound sentiment in [-1, 1]; hf_classifier: a sequence classifier from "
        "`path`; python: the callable `function`.",
    )
    path: str | None = Field(None, description="hf_classifier: local model folder.")
    label: int = Field(-1, description="hf_classifier: index of the logit used as reward (-1: the last).")
    function: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="python: `module:function`, called as f(prompts, responses, **kwargs) -> list of floats.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="python: keyword arguments of `function`; hf_classifier: `input` (pair or response), "
        "`batch_size`, `max_length`.",
    )
    max_batch_size: int = Field(64, ge=1, description="Triton's largest dynamic batch.")
    max_queue_delay_us: int = Field(2000, ge=0, description="Triton dynamic batcher's wait for a fuller batch.")
    timeout_s: float = Field(60.0, gt=0, description="Client timeout of one reward request.")
    max_retries: int = Field(5, ge=0, description="Client retries (exponential back-off) before giving up.")

    @model_validator(mode="after")
    def _needs(self) -> RewardSpec:
        if self.type == "hf_classifier" and not self.path:
            raise ValueError("type hf_classifier needs path")
        if self.type == "python" and not self.function:
            raise ValueError("type python needs function")
        return self

    @property
    def uses_environment(self) -> bool:
        """The reward runs code in the environment service (CODE_TESTS_REWARD): the reward server gets its URL and
        token."""
        return self.type == "python" and self.function == CODE_TESTS_REWARD


class DataSpec(_Section):
    """The prompts the trainer feeds, and how they are tokenised."""

    prompts: str = Field(
        ...,
        description="Prompts: JSON lines (.jsonl), plain text with one prompt per line (.txt), Parquet (.parquet, "
        "veRL's format) or a Hugging Face `datasets` folder saved with save_to_disk. In JSON lines, Parquet and "
        "datasets the column `prompt_field` holds a string or a chat message list ([{role, content}, ...]).",
    )
    validation_prompts: str | None = Field(
        None,
        description="Validation prompts, in the formats of `prompts`: evaluated (never trained on) at the start, "
        "every training.val_every steps and at the end (section `validation`). None: no validation.",
    )
    prompt_field: str = Field(
        "prompt",
        min_length=1,
        description="JSON lines, Parquet, datasets: the field/column holding the prompt. A chat message list "
        "gives its last user message as the prompt and its system message as the system prompt.",
    )
    chat_template: bool = Field(True, description="Wrap each prompt in the tokenizer's chat template.")
    system_prompt: str | None = Field(None, description="System message for the chat template (None: none).")
    max_prompt_tokens: int = Field(
        128, ge=1, description="Longer prompts are truncated from the left, or skipped (`on_long_prompt`)."
    )
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded).")
    on_bad_line: Literal["error", "skip"] = Field(
        "error",
        description="What a malformed prompt line does: error stops with file:line; skip leaves it out with a "
        "warning naming file:line, and counts it.",
    )
    on_long_prompt: Literal["truncate", "skip"] = Field(
        "truncate",
        description="A prompt longer than max_prompt_tokens: truncate keeps its last tokens (and BOS); skip "
        "takes the next prompt instead (metrics `data/truncated_prompts`, `data/skipped_long_prompts`).",
    )
    loader: Literal["default", "dali"] = Field(
        "default",
        description="default: the trainer reads `prompts` (a file) and tokenizes as it feeds. dali: `prompts` is a "
        "folder of pre-tokenized .npy shards written by `reinforce shard-prompts`, read with NVIDIA DALI's numpy "
        "reader in the same seeded order (the `dali` extra); for millions of prompts.",
    )


# algorithm.loss_aggregation (trainer/algorithms/aggregation.py has the math).
LossAggregation = Literal["token_mean", "sequence_mean", "constant"]


class AlgorithmSpec(_Section):
    """REINFORCE or PPO, with a KL penalty to the reference (docs/algorithms.md; NeMo-Aligner names)."""

    name: AlgorithmName = Field(
        "reinforce",
        description="reinforce: REINFORCE with a group baseline (`advantage_estimator`); ppo: PPO with the critic "
        "service (section `critic`), GAE and the clipped objective.",
    )
    advantage_estimator: AdvantageEstimator = Field(
        "rloo",
        description="reinforce: rloo (leave-one-out baseline of the properly-ended others), grpo (group mean and "
        "std, TRL), dr_grpo (group mean, no std division; Dr. GRPO), reinforce_plus_plus (per-token KL rewards, "
        "returns whitened over the step's batch, OpenRLHF). Group and batch statistics count kept samples only.",
    )
    baseline_samples: Literal["ended", "all"] = Field(
        "ended",
        description="rloo: the samples the leave-one-out baseline averages: ended (the other properly-ended ones, "
        "NeMo-Aligner; a prompt with fewer than two ended samples gives no signal) or all (the other k - 1, TRL and "
        "OpenRLHF; responses cut by max_new_tokens still teach).",
    )
    num_rollouts_per_prompt: int = Field(
        4, ge=2, description="k: samples per prompt (at least 2: the leave-one-out baseline needs another sample)."
    )
    initial_policy_kl_penalty: float = Field(0.01, ge=0, description="beta of rewards_with_kl = r - beta*KL.")
    use_absolute_kl: bool = Field(True, description="With kl_estimator k1, average |d_t| instead of d_t.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k1", description="k1: d; k2: d^2/2; k3: exp(-d) - 1 + d, with d = log pi - log pi_ref per token."
    )
    kl_clamp: float | None = Field(
        10.0,
        gt=0,
        description="Each token's KL estimate is clamped to [-kl_clamp, kl_clamp] (OpenRLHF and NeMo-RL: 10; null: "
        "no clamp, as NeMo-Aligner and TRL).",
    )
    loss_aggregation: LossAggregation = Field(
        "token_mean",
        description="How the per-token loss terms add up (the actor loss, for ppo): token_mean (sum over the step's "
        "response tokens / their number N; NeMo-Aligner, veRL token-mean), sequence_mean (each sample's token mean, "
        "averaged over the S samples; veRL seq-mean-token-mean, TRL GRPO loss_type grpo) or constant (sum / (S * "
        "loss_normalizer); Dr. GRPO, TRL GRPO dr_grpo; loss_normalizer 1 is TRL RLOO's).",
    )
    loss_normalizer: float | None = Field(
        None,
        gt=0,
        description="loss_aggregation constant: C, the tokens per sample the token sum is divided by (default "
        "generation.max_new_tokens, as Dr. GRPO; 1: TRL RLOOTrainer's per-sequence log-prob sum).",
    )
    max_policy_lag: int = Field(
        0,
        ge=0,
        description="0: strictly on-policy. n > 0: generators keep sampling while the trainer trains, with "
        "weights up to n versions old, corrected by truncated importance weights.",
    )
    importance_weight_cap: float = Field(
        2.0,
        gt=0,
        description="Cap of the per-token importance weight pi / mu (max_policy_lag > 0, correct_engine_mismatch).",
    )
    correct_engine_mismatch: bool | None = Field(
        None,
        description="reinforce: weight each token by the truncated importance weight min(pi / mu, cap) also "
        "on-policy, where mu is the generator's own log-prob: a bfloat16 engine samples from a slightly different "
        "distribution than the trainer's float32 recomputation. null (default): on for every engine but torch.",
    )
    discount_factor: float = Field(1.0, ge=0, le=1, description="ppo: gamma of GAE.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="ppo: lambda of GAE.")
    ppo_epochs: int = Field(1, ge=1, description="ppo: passes over the step's batch.")
    num_minibatches: int = Field(
        1, ge=1, description="ppo: optimizer steps per epoch (actor and critic); prompts_per_step must divide by it."
    )
    ratio_eps: float = Field(
        0.2, gt=0, description="ppo: eps of the clipped ratio clip(pi / pi_old, 1 - eps, 1 + eps)."
    )
    entropy_bonus: float = Field(0.0, ge=0, description="ppo: c_H of L_actor = L_clip - c_H * H.")
    ppo_loss_mask: Literal["ended", "all"] = Field(
        "ended",
        description="ppo: the tokens L_clip and H average over: ended (properly-ended responses only, NeMo-Aligner's "
        "actor: a response cut by max_new_tokens adds no gradient) or all (every kept response).",
    )
    ratio_eps_low: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Lower clip: rho >= 1 - ratio_eps_low (null: ratio_eps). ppo and policy_loss clip.",
    )
    ratio_eps_high: float | None = Field(
        None,
        gt=0,
        description="Upper clip: rho <= 1 + ratio_eps_high (null: ratio_eps; DAPO's clip-higher: 0.28 with 0.2 low).",
    )
    policy_loss: Literal["reinforce", "clip", "gspo"] = Field(
        "reinforce",
        description="reinforce's loss: reinforce (-A log pi, times the truncated importance weight where it applies), "
        "clip (the clipped surrogate of the token ratio pi / mu, mu the generator's log-probs: PPO's, DAPO's with "
        "ratio_eps_low/high) or gspo (the sequence ratio exp(mean_t log pi / mu), clipped by gspo_eps_low/high).",
    )
    gspo_eps_low: float = Field(3e-4, gt=0, lt=1, description="policy_loss gspo: s_i >= 1 - gspo_eps_low (GSPO's).")
    gspo_eps_high: float = Field(4e-4, gt=0, description="policy_loss gspo: s_i <= 1 + gspo_eps_high (GSPO's).")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling: a group whose rewards are all equal is filtered (acknowledged, "
        "recorded in trained_groups.jsonl, not trained) and a new prompt replaces it.",
    )
    max_filtered_groups: int = Field(
        32,
        ge=0,
        description="dynamic_sampling: at most this many groups of a step are filtered; beyond, the step trains on "
        "the groups that arrive.",
    )
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="DAPO's overlong shaping: a response longer than max_new_tokens - overlong_buffer tokens loses "
        "overlong_penalty * (its excess / overlong_buffer) of reward (null: off).",
    )
    overlong_penalty: float = Field(1.0, ge=0, description="overlong_buffer: the penalty at max_new_tokens.")

    @model_validator(mode="after")
    def _normalizer_only_for_constant(self) -> AlgorithmSpec:
        if self.loss_normalizer is not None and self.loss_aggregation != "constant":
            raise ValueError(
                f"loss_normalizer applies to loss_aggregation constant only, not {self.loss_aggregation}: remove it "
                "or set loss_aggregation: constant"
            )
        return self

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) of the ratio's clip: GSPO's for policy_loss gspo, else ratio_eps_low/high."""
        if self.policy_loss == "gspo":
            return self.gspo_eps_low, self.gspo_eps_high
        return self.ratio_eps_low or self.ratio_eps, self.ratio_eps_high or self.ratio_eps


CriticInit = Literal["policy", "reward_model"]


def _betas_are_numbers(betas: Any) -> Any:
    if isinstance(betas, list | tuple) and any(isinstance(b, bool) or not isinstance(b, int | float) for b in betas):
        raise ValueError("both betas must be numbers")
    return betas


def _betas_in_unit_interval(betas: tuple[float, float]) -> tuple[float, float]:
    if not all(0 <= b < 1 for b in betas):
        raise ValueError(f"each beta must be in [0, 1), got {list(betas)}")
    return betas


# AdamW's betas, the trainer's and the critic's. Not strict: YAML has lists, not tuples; each element is still checked.
AdamBetas = Annotated[
    tuple[float, float],
    BeforeValidator(_betas_are_numbers),
    AfterValidator(_betas_in_unit_interval),
    Field(strict=False),
]


class CriticSpec(_Section):
    """ppo: the critic service's value model and optimizer (defaults: NeMo-Aligner's gpt_ppo_critic.yaml)."""

    init: CriticInit = Field(
        "policy",
        description="policy: the initial policy's body with a zero value head; reward_model: the sequence "
        "classifier (num_labels 1) at `reward_model_path`, which must share the policy's tokenizer.",
    )
    reward_model_path: str | None = Field(None, description="init reward_model: its Hugging Face folder.")
    lr: float = Field(9e-6, gt=0, description="AdamW learning rate (constant).")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    adam_betas: AdamBetas = Field((0.9, 0.98), description="AdamW betas, each in [0, 1).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping by global norm.")
    value_clip: float = Field(
        0.2, ge=0, description="eps_v of the clipped value loss (NeMo-Aligner's loss_clip_val; 0: off)."
    )
    micro_batch_tokens: int | None = Field(
        2048,
        ge=1,
        description="Tokens per forward/backward of the value model, counted as training.micro_batch_tokens counts "
        "them (each run of equal prompts once, padded to the longest prompt, plus every response but its last token, "
        "padded to the longest); sequences are packed longest first, one over the budget goes alone, and gradients "
        "accumulate. null: no token limit.",
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="At most this many sequences per forward/backward, on top of micro_batch_tokens (null: the "
        "token budget alone decides).",
    )
    max_request_mb: float = Field(64.0, gt=0, description="Larger request bodies are refused (413) unread.")

    @model_validator(mode="after")
    def _reward_model_needs_path(self) -> CriticSpec:
        if self.init == "reward_model" and not self.reward_model_path:
            raise ValueError("init reward_model needs reward_model_path")
        return self


BUILTIN_TOOLS = ("python", "calculator")  # reinforce.environment.tools


class EnvironmentSpec(_Section):
    """The environment service: episodes of tools (a sandboxed Python, a calculator, user tools) over HTTP."""

    enabled: bool = Field(
        False,
        description="Start the environment service (`reinforce run`: its own process; the operator: its own "
        "Deployment, Service and NetworkPolicy).",
    )
    tools: list[str] = Field(
        default_factory=lambda: ["python", "calculator"],
        min_length=1,
        description="Tools of every episode: built-in `python` (runs the code in the sandbox) and `calculator` "
        "(arithmetic, no code), or `module:Class` naming a subclass of reinforce.environment.tools.Tool.",
    )
    max_turns: int = Field(
        4, ge=1, description="Assistant turns per episode; the last one's tool call is not run (the episode is done)."
    )
    tool_instructions: bool = Field(
        True,
        description="Append how to call the tools (the call format, each tool's name, description and arguments) "
        "to every prompt's system message (data.system_prompt) when data.chat_template; false: the prompts "
        "say it themselves. A chat prompt with a system message of its own keeps that message as it is.",
    )
    time_limit_s: float = Field(
        5.0, gt=0, le=600, description="Wall-clock limit of one tool call; past it the call is stopped: `timeout`."
    )
    output_limit_chars: int = Field(
        2000, ge=64, description="An observation (stdout, stderr, exit code) is cut to this many characters."
    )
    memory_limit_mb: int = Field(
        512,
        ge=64,
        description="python: the address space of each of a call's processes (RLIMIT_AS), and the resident memory "
        "of all of them together, summed every MEMORY_POLL_S of environment/sandbox.py (a call over it is stopped: "
        "`memory_exceeded`; between two looks it may hold more, which the pod's or container's memory limit bounds).",
    )
    file_limit_mb: int = Field(
        16,
        ge=1,
        description="python: largest file the code may write (RLIMIT_FSIZE), and the size of its scratch folder "
        "where it is a tmpfs of its own (namespaced sandboxes).",
    )
    max_processes: int = Field(
        16,
        ge=1,
        description="python: processes and threads at once (RLIMIT_NPROC), which the kernel counts per uid: as root, "
        "per call slot (each has a uid of its own, which no other environment service on the machine holds); otherwise "
        "the calls run as the service's uid, whose every process and thread on the machine counts: the calls then "
        "have max_concurrent_calls x max_processes together, over the service's own threads (the operator's "
        "environment pod runs as a uid of its run's own).",
    )
    max_concurrent_calls: int = Field(
        4,
        ge=1,
        description="Tool calls run at once; more wait their turn (the wait is not on their time limit). Isolation "
        "none without root (the operator's environment pod, the compose container) runs one at a time unless "
        "unsafe_concurrent_calls.",
    )
    unsafe_concurrent_calls: bool = Field(
        False,
        description="Isolation none without root: run max_concurrent_calls at once although the calls share the "
        "service's uid, so that each can read and change the others' files and signal their processes. Off, they run "
        "one at a time and what one left in /tmp, /var/tmp or /dev/shm is removed before the next.",
    )
    unsafe_unconfined_calls: bool = Field(
        False,
        description="Run tool calls under isolation none outside a container or pod (the service is not PID 1), "
        "where nothing but rlimits confines them: the code can open network connections and read and write what "
        "the service's user can. Off, such a service refuses to start, naming this field.",
    )
    max_episodes: int = Field(
        256, ge=1, description="Open episodes; starting one more is refused (429) until one ends or expires."
    )
    max_episodes_per_caller: int = Field(
        64,
        ge=1,
        description="Open episodes of one caller (a generator); starting one more is refused (429), so that one "
        "caller cannot take every episode. A generator opens generation.batch_prompts x "
        "algorithm.num_rollouts_per_prompt at once.",
    )
    episode_idle_s: float = Field(
        600.0, gt=0, description="An episode without a step for this long is ended (its generator is gone)."
    )

    @model_validator(mode="after")
    def _tools_are_known(self) -> EnvironmentSpec:
        for tool in self.tools:
            if tool not in BUILTIN_TOOLS and ":" not in tool:
                raise ValueError(
                    f"tools: {tool!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor module:Class"
                )
        if len(set(self.tools)) != len(self.tools):
            raise ValueError(f"tools: {self.tools} names a tool twice")
        return self


class GenerationSpec(_Section):
    """Sampling by the generators."""

    engine: Literal["auto", EngineName] = Field(
        "auto",
        description="What samples: torch (the reference sampler, a KV cache in PyTorch), vllm (vLLM in the "
        "generator's process, CPU or GPU; `make install` installs its CPU build) or tensorrt_llm (TensorRT-LLM's LLM "
        "API, GPU only). Every engine refits published weights in place. auto: `reinforce run` picks vllm where vLLM "
        "is installed and can run the policy, else torch, and writes its choice into the run folder's spec.yaml; "
        "where no `reinforce run` chose (a ReinforceRun, docker-compose, a service started by hand), auto is torch.",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="The engine's weights and activations: auto is float32 for torch; for vllm and tensorrt_llm "
        "bfloat16 where the machine multiplies it in hardware (a GPU of compute capability 8.0 or higher, an x86 "
        "CPU with AMX or AVX512-BF16), float32 elsewhere, where bfloat16 is emulated and slower. Each service "
        "resolves auto on its own machine: where the trainer's and the generators' differ, name the dtype. "
        "Log-probs are float32 either way; the trainer reports their difference from its own "
        "(`train_rollouts/logprob_mismatch`) and corrects for it (`algorithm.correct_engine_mismatch`).",
    )
    max_new_tokens: int = Field(
        48, ge=1, le=65536, description="Response length limit; a response that hits it did not end."
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (log-probs use the same scaling).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1: off).")
    top_k: int = Field(0, ge=0, description="Sample among the k likeliest tokens (0: off).")
    stop_strings: list[str] = Field(default_factory=list, description="A response ends after any of these.")
    num_generators: int = Field(
        1,
        ge=1,
        description="Generator processes the supervisor starts; on Kubernetes the generator Deployment's replicas.",
    )
    batch_prompts: int = Field(8, ge=1, description="Prompts a generator samples together (times k sequences).")
    reclaim_idle_s: float = Field(
        60.0, gt=0, description="A prompt unacknowledged this long (its generator died) is taken over by another."
    )

    def resolved_engine(self) -> EngineName:
        """`engine` as the services read it: auto, where `reinforce run` did not replace it with its choice
        (supervisor/engine_choice.py), is torch."""
        return "torch" if self.engine == "auto" else self.engine

    def resolved_dtype(self, bfloat16_native: bool) -> Literal["float32", "bfloat16"]:
        """`dtype` with auto resolved: float32 for the torch reference; for the fast engines bfloat16 where the
        machine multiplies it in hardware (`bfloat16_native`: core/hardware.py), else float32."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_engine() != "torch" and bfloat16_native else "float32"


class LoraSpec(_Section):
    """LoRA adapters (PEFT) on the torch backend: only the adapters train and travel to the generators."""

    rank: int = Field(8, ge=1, description="r: rank of each adapter.")
    alpha: float = Field(16.0, gt=0, description="Scaling numerator: the update is (alpha / rank) * B @ A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input (0: none).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the Linear modules that get an adapter (PEFT's target_modules); the generators "
        "refuse a weight version with an adapter of any other.",
    )


class TrainingSpec(_Section):
    """The optimisation: steps, batch, AdamW, schedule, checkpoints."""

    backend: BackendName = Field(
        "torch",
        description="What trains: torch (Hugging Face model, AdamW, data parallelism over torchrun ranks) or "
        "megatron (Megatron-core GPTModel of a Llama policy with tensor parallelism; the `megatron` extra).",
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="auto: on the torch backend bf16 where the trainer's CPU multiplies bfloat16 in hardware (AMX "
        "or AVX512-BF16), the faster of the two there, and fp32 elsewhere, where bfloat16 is emulated and slower; "
        "fp32 on megatron, which trains in float32. fp32: everything float32 (bit-reproducible: set it for "
        "exactness studies and for tests that compare runs to float32 noise). bf16 (torch backend): the policy's "
        "forward and backward on a bfloat16 copy of its float32 master weights, gradients added up in float32 and "
        "AdamW's state float32 (LoRA: the adapters under autocast), the reference model held in bfloat16; "
        "log-probs and the loss in float32. "
        "Weight versions travel in the generators' precision (generation.dtype) either way.",
    )
    attention: Literal["auto", "sdpa", "eager"] = Field(
        "auto",
        description="The torch backend's attention kernel (Hugging Face attn_implementation) for the policy and the "
        "reference. auto: on CPU eager (plain matmuls) for micro-batches padded to at most 256 tokens and sdpa "
        "beyond, the faster of the two on CPU at each length; sdpa on GPU.",
    )
    allocator: Literal["system", "jemalloc"] = Field(
        "system",
        description="The trainer process's memory allocator. system: the C library's malloc. jemalloc (Debian's "
        "libjemalloc2: the project's images and `make install` have it; refused where it is not installed): less "
        "resident memory for long responses, whose tensors change size with every micro-batch, at the cost of "
        "slower steps (it returns freed pages to the system and faults them in again). The trainer loads it by "
        "starting itself again with LD_PRELOAD.",
    )
    steps: int = Field(20, ge=1, description="Optimisation steps (one per rollout batch).")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per step; the batch is prompts_per_step * k.")
    num_ranks: int = Field(
        1,
        ge=1,
        description="Trainer processes (torchrun; gloo on CPU, NCCL on GPU): data-parallel ranks x tensor_parallel x "
        "pipeline_parallel.",
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        description="backend megatron: processes each model replica is split over (Megatron tensor parallelism); "
        "must divide num_ranks and the policy's attention heads, KV heads and MLP width.",
    )
    pipeline_parallel: int = Field(
        1,
        ge=1,
        description="backend megatron: pipeline stages. Only 1: Megatron's pipeline schedules allocate on CUDA "
        "and the trainer does not drive them yet.",
    )
    micro_batch_tokens: int | None = Field(
        2048,
        ge=1,
        description="Tokens per forward/backward of every pass (reference, log-probs, training), counted as the "
        "forward computes them: on the torch backend each run of equal prompts (a group's k samples) once, padded to "
        "the longest prompt, plus every response but its last token, padded to the longest; on megatron every row's "
        "prompt + response, padded. Gradients accumulate. Sequences are packed longest first; a sequence (or a group, "
        "where the advantage estimator needs whole groups) over the budget goes alone. Activation memory grows with "
        "these tokens, so a fixed budget keeps a step's peak memory flat as responses grow; a GPU with memory to spare "
        "runs larger budgets faster. null: no token limit.",
    )
    micro_batch_prompts: int | None = Field(
        None,
        ge=1,
        description="At most this many prompts' sequences (k each) per forward/backward, on top of "
        "micro_batch_tokens (null: the token budget alone decides).",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Activation (gradient) checkpointing of the policy: the training forward keeps only each "
        "transformer layer's input and the backward recomputes the layers from them one at a time, so a micro-batch "
        "no longer holds every layer's intermediate activations at once; the cost is a second forward through the "
        "layers during the backward. On megatron: Megatron's full recompute. The reference and the passes without "
        "gradients are unaffected.",
    )
    lr: float = Field(1e-6, gt=0, description="AdamW peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: AdamBetas = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="After warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up from 0 to lr.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine: final lr as a fraction of lr.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping by global norm.")
    max_logprob_mismatch: float = Field(
        0.5,
        gt=0,
        description="A group whose mean |generator log-prob - trainer log-prob| under the weights of the version it "
        "claims (the one being trained, or with max_policy_lag one of the last ones, which the trainer keeps) "
        "exceeds this is refused and counted (`train_rollouts/refused_mismatched_groups`): other weights sampled it "
        "(docs/engines.md, for the engines' usual mismatch). After a restart, a group claiming a version from before "
        "it is refused too: its weights are gone.",
    )
    checkpoint_every: int = Field(10, ge=1, description="Write a checkpoint every this many steps (and at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept; older ones are deleted.")
    lora: LoraSpec | None = Field(
        None,
        description="Train LoRA adapters instead of every weight (the `lora` extra: PEFT). The reference is the "
        "base model with the adapters disabled; generators receive only adapter weights; final_model/ is merged, "
        "final_model/adapter/ the adapter alone.",
    )
    val_every: int = Field(
        0,
        ge=0,
        description="With data.validation_prompts: evaluate every this many steps, and always at the start and "
        "the end (0: only at the start and the end).",
    )

    def resolved_precision(self, bfloat16_native: bool) -> Literal["fp32", "bf16"]:
        """`precision` with auto resolved: bf16 on the torch backend where the trainer's CPU multiplies bfloat16 in
        hardware (`bfloat16_native`: core/hardware.py), else fp32; fp32 on megatron (which trains in float32)."""
        if self.precision != "auto":
            return self.precision
        return "bf16" if self.backend == "torch" and bfloat16_native else "fp32"

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: the replicas of the model, each reading its own share of the groups."""
        return self.num_ranks // (self.tensor_parallel * self.pipeline_parallel)

    @model_validator(mode="after")
    def _ranks_lay_out(self) -> TrainingSpec:
        if self.pipeline_parallel > 1:
            raise ValueError(
                "training.pipeline_parallel > 1 is not supported: Megatron-core's pipeline schedules need CUDA "
                "(device='cuda' is hard-coded) and this trainer runs whole replicas (use tensor_parallel)"
            )
        if self.backend == "torch" and self.tensor_parallel > 1:
            raise ValueError("training.tensor_parallel > 1 needs training.backend megatron")
        if self.backend == "megatron" and self.lora is not None:
            raise ValueError("training.lora is implemented on training.backend torch only")
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if self.num_ranks % model_parallel:
            raise ValueError(
                f"training.num_ranks ({self.num_ranks}) must be a multiple of training.tensor_parallel x "
                f"training.pipeline_parallel ({model_parallel}): data x tensor x pipeline ranks"
            )
        return self


class ValidationSpec(_Section):
    """Evaluation on data.validation_prompts through the same generators and reward server; never trained on."""

    num_prompts: int = Field(
        32, ge=1, description="Validation prompts per evaluation: the file's first ones (fewer if it has fewer)."
    )
    temperature: float = Field(0.0, ge=0, description="Sampling temperature of validation responses (0: greedy).")
    num_logged_responses: int = Field(
        4, ge=0, description="Responses per evaluation written to validation/step-NNNNNN.jsonl."
    )


class LoggingSpec(_Section):
    """Where the trainer's main rank writes the step metrics besides metrics.jsonl and Prometheus; component logs."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="Experiment trackers, each an optional extra (pip install 'reinforce-k8s[NAME]'): tensorboard "
        "(RUN_DIR/tensorboard), wandb (offline, RUN_DIR/wandb), mlflow (file store RUN_DIR/mlruns). Same metric "
        "names as metrics.jsonl, the spec as the run's config; a resumed run continues the same tracker run.",
    )
    project: str | None = Field(None, description="wandb project / mlflow experiment name (default: the run name).")
    samples_every: int = Field(
        1,
        ge=0,
        description="Every this many steps the trainer's main rank writes num_samples of the step's samples (prompt, "
        "response, reward, advantage, KL, length) to RUN_DIR/samples/step-NNNNNN.jsonl and each tracker (0: never).",
    )
    num_samples: int = Field(
        4,
        ge=1,
        description="Samples written per step: the best and the worst by reward, then the step's first ones (the main "
        "rank's share of the step).",
    )
    max_component_log_mb: float = Field(
        64.0,
        gt=0,
        description="`reinforce run`: a component's log (RUN_DIR/logs/NAME.log) past this size is copied to "
        "NAME.log.1, replacing the older copy, and emptied. Local only: on Kubernetes the kubelet rotates "
        "container logs.",
    )


class WeightsSpec(_Section):
    """How weight versions travel from the trainer to the generators."""

    transport: Literal["file", "http"] = Field(
        "file",
        description="file: generators read the run folder (a shared volume); http: they stream each version "
        "from the trainer's weight endpoint. Both check the sha256 before loading. On Kubernetes always http: "
        "the operator sets it, as pods share no volume.",
    )
    keep_versions: int = Field(3, ge=1, description="Published versions kept on the trainer's disk.")
    distribution: Literal["direct", "relay"] | None = Field(
        None,
        description="With transport http: direct (every generator fetches each version from the trainer) or relay "
        "(the trainer sends it once; generators pass it on as it arrives, along a tree of fan-out `relay_fanout`, "
        "each chunk checked against its published sha256). Unset: relay on Kubernetes, direct locally.",
    )
    relay_fanout: int = Field(
        1, ge=1, le=64, description="relay: successors each generator forwards a version to (1: a chain)."
    )
    relay_stall_s: float = Field(
        10.0, gt=0, description="relay: a source that sends nothing this long is left for the next one up the tree."
    )
    relay_deadline_s: float = Field(
        120.0,
        gt=0,
        description="relay: the ancestors' relays have this long to send a version whole; what is missing then comes "
        "from the trainer (a source that trickles bytes never stalls).",
    )


class QueueSpec(_Section):
    """The Redis rollout queue, as its clients (trainer, generators) use it."""

    max_outage_s: float = Field(
        60.0,
        gt=0,
        description="How long trainer and generators ride out Redis being unreachable (a restart, a rescheduled "
        "pod), retrying with back-off, before they give up and exit.",
    )


class RestartSpec(_Section):
    """How the local supervisor restarts a crashed component (Kubernetes' restart policy does it on a cluster)."""

    max_restarts: int = Field(
        3,
        ge=0,
        description="Restarts of one component before the run gives up (0: none), counted since its restart count "
        "was last reset (`reset_after_s`). On Kubernetes the crash-loop threshold: the operator marks the run Failed "
        "(CrashLooping) once a pod has restarted more often.",
    )
    backoff_s: float = Field(
        1.0,
        gt=0,
        description="Wait before the first restart; doubles with each restart. Unused on Kubernetes (the kubelet's "
        "CrashLoopBackOff spaces restarts).",
    )
    max_backoff_s: float = Field(
        30.0, gt=0, description="Longest wait between restarts. Unused on Kubernetes (the kubelet's back-off)."
    )
    reset_after_s: float = Field(
        600.0,
        gt=0,
        description="A component that ran this long since its last restart has its restart count (and back-off) "
        "reset to zero, as the kubelet resets its back-off after 10 minutes: faults hours apart do not end a long "
        "run. Local only: on Kubernetes the restart count is the pod's, kept as long as the pod lives.",
    )


class RunSpec(_Section):
    """A whole run: `reinforce run SPEC.yaml`."""

    name: str = Field(
        ...,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
        description="Run name (a DNS label); namespaces the run's Redis keys.",
    )
    seed: int = Field(0, ge=0, description="Seeds data order, model init and sampling.")
    run_dir: str | None = Field(None, description="Run folder (default: runs/<name>).")
    policy: PolicySpec
    reward: RewardSpec = Field(default_factory=RewardSpec)
    data: DataSpec
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    critic: CriticSpec = Field(default_factory=CriticSpec)
    environment: EnvironmentSpec = Field(default_factory=EnvironmentSpec)
    generation: GenerationSpec = Field(default_factory=GenerationSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    validation: ValidationSpec = Field(default_factory=ValidationSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    weights: WeightsSpec = Field(default_factory=WeightsSpec)
    queue: QueueSpec = Field(default_factory=QueueSpec)
    restart: RestartSpec = Field(default_factory=RestartSpec)

    @model_validator(mode="after")
    def _groups_split_evenly_across_ranks(self) -> RunSpec:
        t = self.training
        if t.prompts_per_step % t.data_parallel:
            raise ValueError(
                f"training.prompts_per_step ({t.prompts_per_step}) must be a multiple of the data-parallel ranks "
                f"({t.data_parallel} = training.num_ranks / tensor_parallel / pipeline_parallel): every rank trains "
                "the same number of whole prompt groups"
            )
        a = self.algorithm
        if a.name == "ppo":
            if t.data_parallel > 1 and t.backend != "torch":
                # the ranks' gather for the critic is tested on the torch backend only
                raise ValueError(
                    "algorithm.name ppo over several data-parallel ranks needs training.backend torch: on megatron, "
                    "training.num_ranks must equal training.tensor_parallel"
                )
            if a.correct_engine_mismatch:
                raise ValueError("algorithm.correct_engine_mismatch is reinforce's: leave it unset with ppo")
            if a.policy_loss != "reinforce":
                raise ValueError("algorithm.policy_loss is reinforce's (ppo's loss is always clipped): leave it unset")
            if t.prompts_per_step % a.num_minibatches:
                raise ValueError(
                    f"training.prompts_per_step ({t.prompts_per_step}) must be a multiple of "
                    f"algorithm.num_minibatches ({a.num_minibatches})"
                )
        return self

    @model_validator(mode="after")
    def _dapo_settings_fit(self) -> RunSpec:
        a, t = self.algorithm, self.training
        if a.dynamic_sampling and (a.max_policy_lag > 0 or t.data_parallel > 1):
            # the main rank draws a filtered group's replacement from the data cursor while the step collects
            raise ValueError(
                "algorithm.dynamic_sampling needs algorithm.max_policy_lag 0 and one data-parallel rank "
                "(training.num_ranks = tensor_parallel x pipeline_parallel)"
            )
        if a.overlong_buffer is not None and a.overlong_buffer > self.generation.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer ({a.overlong_buffer}) must not exceed generation.max_new_tokens "
                f"({self.generation.max_new_tokens})"
            )
        return self

    @model_validator(mode="after")
    def _prompt_and_response_fit_a_random_policy(self) -> RunSpec:
        # A loaded policy's limit is known only once it is read: the supervisor checks that one (check_fits_policy).
        init = self.policy.random_init
        if init is not None:
            check_fits_policy(self, init.max_position_embeddings, "policy.random_init.max_position_embeddings")
        return self

    @model_validator(mode="after")
    def _lora_needs_an_engine_that_loads_adapters(self) -> RunSpec:
        lora = self.training.lora
        if lora is None:
            return self
        if self.generation.resolved_engine() == "tensorrt_llm":
            raise ValueError(
                "training.lora sends adapter-only weight versions, which generation.engine tensorrt_llm does not "
                "load yet: use generation.engine torch or vllm"
            )
        if self.generation.resolved_engine() == "vllm" and lora.rank > 512:
            raise ValueError(f"training.lora.rank {lora.rank}: vLLM loads adapters up to rank 512")
        return self

    @model_validator(mode="after")
    def _code_tests_need_the_environment(self) -> RunSpec:
        if self.reward.uses_environment and not self.environment.enabled:
            raise ValueError(
                f"reward.function {CODE_TESTS_REWARD} runs the tests in the environment service: set "
                "environment.enabled (with environment.max_turns 1 for single-turn answers)"
            )
        return self

    @model_validator(mode="after")
    def _episodes_fit_the_environment(self) -> RunSpec:
        # Every sample of a generator's batch is an open episode: more than max_episodes would be refused (429)
        # batch after batch.
        if self.environment.enabled:
            episodes = self.generation.num_generators * self.generation.batch_prompts
            episodes *= self.algorithm.num_rollouts_per_prompt
            if episodes > self.environment.max_episodes:
                raise ValueError(
                    f"environment.max_episodes ({self.environment.max_episodes}) is below the episodes the generators "
                    f"open at once: generation.num_generators x generation.batch_prompts x "
                    f"algorithm.num_rollouts_per_prompt = {episodes}"
                )
            each = self.generation.batch_prompts * self.algorithm.num_rollouts_per_prompt
            if each > self.environment.max_episodes_per_caller:
                raise ValueError(
                    f"environment.max_episodes_per_caller ({self.environment.max_episodes_per_caller}) is below the "
                    f"episodes a generator opens at once: generation.batch_prompts x "
                    f"algorithm.num_rollouts_per_prompt = {each}"
                )
        return self

    def corrects_engine_mismatch(self) -> bool:
        """algorithm.correct_engine_mismatch, its null resolved: on for engines other than the torch reference."""
        configured = self.algorithm.correct_engine_mismatch
        if configured is None:
            return self.algorithm.name == "reinforce" and self.generation.resolved_engine() != "torch"
        return configured

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or f"runs/{self.name}")


def check_fits_policy(spec: RunSpec, limit: int, limit_name: str = "the policy's max_position_embeddings") -> None:
    """The longest prompt plus the longest response must fit the policy's positions, or sampling fails later."""
    need = spec.data.max_prompt_tokens + spec.generation.max_new_tokens
    if need > limit:
        raise ValueError(
            f"data.max_prompt_tokens ({spec.data.max_prompt_tokens}) + generation.max_new_tokens "
            f"({spec.generation.max_new_tokens}) = {need} exceeds {limit_name} ({limit})"
        )


def _field_path(loc: tuple[Any, ...]) -> str:
    # pydantic puts validator/union tags in loc ("function-after[...]"); users want only the data path.
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))]
    return ".".join(parts) or "(top level)"


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid run spec"]
    for e in err.errors():
        lines.append(f"  {_field_path(e['loc'])}: {e['msg']}")
    return "\n".join(lines)


def parse_spec(data: Any, source: str = "spec") -> RunSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a run spec must be a mapping, got {type(data).__name__}")
    if too_deep := _nested_too_deep(data):
        raise SpecError(f"{source}: {too_deep}: nested deeper than {MAX_SPEC_DEPTH} levels")
    try:
        return RunSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, source)) from None


def _nested_too_deep(data: Any) -> str | None:
    """The field path (its first levels) of a value nested past MAX_SPEC_DEPTH, or None. Iterative: a deep value
    must not be a RecursionError here either (specs also come from the Kubernetes API, not only from YAML)."""
    stack: list[tuple[Any, int, str]] = [(data, 0, "")]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_SPEC_DEPTH:
            return path
        children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, child in children:
            step = f"[{key}]" if isinstance(value, list) else f".{key}" if path else str(key)
            stack.append((child, depth + 1, path + step if depth < 3 else path.removesuffix("...") + "..."))
    return None


class _Refused(yaml.YAMLError):
    """YAML the spec loader does not take (an alias, too deep a nesting); the message names the line."""


class _SpecLoader(yaml.SafeLoader):
    """safe_load without aliases and with a nesting cap. An alias shares a node, so a 1 KB file of nested aliases
    stands for gigabytes once anything walks or dumps it (the supervisor writes the spec back); and PyYAML
    composes nodes recursively, so a deep enough nesting would be a RecursionError."""

    def __init__(self, stream: bytes) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(f"line {line}: YAML aliases (*{event.anchor}) are not allowed in a run spec")
        if self._depth >= MAX_SPEC_DEPTH:
            raise _Refused(f"line {line}: nested deeper than {MAX_SPEC_DEPTH} levels")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_spec(path: str | Path) -> RunSpec:
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as err:
        raise SpecError(f"{path}: cannot read run spec: {err.strerror}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: larger than {MAX_SPEC_BYTES} bytes, too large for a run spec")
    try:
        data = yaml.load(raw, Loader=_SpecLoader)  # a SafeLoader, stricter still
    except _Refused as err:
        raise SpecError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {err}") from None
    return parse_spec(data, str(path))


def dump_spec(spec: RunSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)


def respell(data: Any, model: type[BaseModel], by_alias: bool = True) -> Any:
    """`data`, a mapping of `model`'s fields in either spelling, with each field (nested sections too) spelled by its
    camelCase alias (by_alias) or its snake_case name. Keys of map-valued fields (labels, resources, reward.kwargs)
    and keys that are no field are left as they are: validation names those. A field given in both spellings takes
    its snake_case one: a ReinforceRun stored before the CRD was camelCase holds its own values by name and, read
    through the camelCase CRD, the server's defaults by alias (docs/kubernetes/upgrading.md)."""
    if not isinstance(data, dict):
        return data
    fields = {key: (name, field) for name, field in model.model_fields.items() for key in (name, field.alias or name)}
    out = {}
    for key, value in data.items():
        if key not in fields:
            out[key] = value
            continue
        name, field = fields[key]
        if key != name and name in data:
            continue  # the alias of a field also given by name
        out[field.alias if by_alias and field.alias else name] = _respell_value(value, field.annotation, by_alias)
    return out


def _respell_value(value: Any, annotation: Any, by_alias: bool) -> Any:
    sections = [a for a in getattr(annotation, "__args__", (annotation,)) if _is_section(a)]
    if not sections:
        return value
    origin = getattr(annotation, "__origin__", None)
    if origin is list and isinstance(value, list):
        return [respell(item, sections[0], by_alias) for item in value]
    if origin is dict and isinstance(value, dict):
        return {key: respell(item, sections[0], by_alias) for key, item in value.items()}
    return respell(value, sections[0], by_alias)


class ReferenceRow(NamedTuple):
    """One field of a spec reference: the docs' reference tables and the chart's values.yaml are written from these."""

    path: str
    type: str
    default: str
    meaning: str


def reference_markdown(model: type[BaseModel] = RunSpec, skip: tuple[str, ...] = (), by_alias: bool = False) -> str:
    """A spec reference table of the docs, generated from the model (tests check the docs are current); fields
    spelled by name (spec files) or by camelCase alias (Kubernetes objects)."""
    return markdown_table(reference_rows(model, skip, by_alias))


def markdown_table(rows: list[ReferenceRow]) -> str:
    lines = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for r in rows:
        meaning = r.meaning.replace("|", "\\|")  # a table cell's pipe
        lines.append(f"| `{r.path}` | {r.type} | {r.default} | {meaning} |")
    return "\n".join(lines)


def reference_rows(
    model: type[BaseModel],
    skip: tuple[str, ...] = (),
    by_alias: bool = False,
    prefix: str = "",
    seen: dict | None = None,
) -> list[ReferenceRow]:
    """Every field of model and of the models under it, each section's fields listed once (`seen`: section class ->
    where its fields are listed); a list or dict of sections lists one element's fields under [] or .<name>."""
    seen = {} if seen is None else seen
    rows = []
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        path = prefix + (field.alias if by_alias and field.alias else name)
        annotation = field.annotation
        sections = [a for a in getattr(annotation, "__args__", (annotation,)) if _is_model(a)]
        default = "required" if field.is_required() else _default_text(field)
        if not sections:
            rows.append(ReferenceRow(path, _type_text(annotation), default, field.description or ""))
            continue
        section = sections[0]
        kind = {list: "list of sections", dict: "map of sections"}.get(getattr(annotation, "__origin__", None))
        element = path + {"list of sections": "[]", "map of sections": ".<name>"}.get(kind or "", "")
        meaning = field.description or section.__doc__.strip().splitlines()[0]
        if section in seen:
            meaning += f" Fields as `{seen[section]}`."
        rows.append(ReferenceRow(path, kind or "section", default, meaning))
        if section not in seen:
            seen[section] = element
            rows += reference_rows(section, by_alias=by_alias, prefix=element + ".", seen=seen)
    return rows


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, _Section)


def _default_text(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "defaults" if isinstance(value, BaseModel) else f"`{value!r}`"
    return f"`{field.default!r}`"


def _type_text(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return f"`{text}`".replace("|", "\\|")
