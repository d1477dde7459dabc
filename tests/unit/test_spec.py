"""The run spec: examples load, bad input names the field, nothing crashes the loader."""

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from reinforce.core.spec import RunSpec, SpecError, dump_spec, load_spec, parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MINIMAL = {"name": "t", "policy": {"random_init": {}}, "data": {"prompts": "p.txt"}}


@pytest.mark.parametrize(
    "name",
    [
        "quickstart.yaml",
        "tiny.yaml",
        "quickstart-ppo.yaml",
        "tiny-ppo.yaml",
        "tiny-tools.yaml",
        "arithmetic.yaml",
        "arithmetic-tools.yaml",
    ],
)
def test_examples_load_and_round_trip(name):
    spec = load_spec(EXAMPLES / name)
    assert parse_spec(yaml.safe_load(dump_spec(spec))) == spec


def test_defaults_follow_nemo_aligner():
    spec = parse_spec(MINIMAL)
    assert spec.algorithm.num_rollouts_per_prompt == 4
    assert spec.algorithm.initial_policy_kl_penalty == 0.01
    assert spec.algorithm.use_absolute_kl is True
    assert spec.training.max_grad_norm == 1.0
    assert spec.resolved_run_dir() == Path("runs/t")
    assert (spec.algorithm.name, spec.algorithm.advantage_estimator) == ("reinforce", "rloo")
    # OpenRLHF's and NeMo-RL's KL clamp; NeMo-Aligner's PPO actor mask; one symmetric PPO clip
    assert (spec.algorithm.kl_clamp, spec.algorithm.ppo_loss_mask, spec.algorithm.clip_range()) == (
        10.0,
        "ended",
        (0.2, 0.2),
    )
    # NeMo-Aligner's gpt_ppo_critic.yaml
    c = spec.critic
    assert (c.lr, c.weight_decay, c.adam_betas, c.max_grad_norm, c.value_clip) == (9e-6, 0.1, (0.9, 0.98), 1.0, 0.2)


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ({"training": {"lr": 0}}, "training.lr: Input should be greater than 0"),
        ({"training": {"steps": "many"}}, "training.steps: Input should be a valid integer"),
        ({"generation": {"top_p": 1.5}}, "generation.top_p: Input should be less than or equal to 1"),
        ({"algorithm": {"kl_estimator": "k4"}}, "algorithm.kl_estimator: Input should be 'k1', 'k2' or 'k3'"),
        ({"algorithm": {"max_policy_lag": -1}}, "algorithm.max_policy_lag: Input should be greater than or equal to 0"),
        ({"generation": {"temprature": 1.0}}, "generation.temprature: Extra inputs are not permitted"),
        ({"policy": {"random_init": {"hidden_size": 30, "num_heads": 4}}}, "policy.random_init: Value error"),
        ({"policy": {"path": "x", "random_init": {}}}, "policy: Value error, set exactly one of path and random_init"),
        ({"reward": {"type": "python"}}, "reward: Value error, type python needs function"),
        ({"reward": {"type": "python", "function": "no colon"}}, "reward.function: String should match pattern"),
        ({"name": "Has Spaces"}, "name: String should match pattern"),
        ({"training": {"prompts_per_step": 6, "num_ranks": 4}}, "training.prompts_per_step (6) must be a multiple"),
        # with one sample RLOO has no baseline: every advantage would be 0 and the run would learn nothing
        ({"algorithm": {"num_rollouts_per_prompt": 1}}, "algorithm.num_rollouts_per_prompt: Input should be greater"),
        # Issue #13, finding 8: no coercion surprises, no infinities, betas in [0, 1), bounded lengths
        ({"training": {"adam_betas": [2, -1]}}, "training.adam_betas: Value error, each beta must be in [0, 1)"),
        ({"training": {"adam_betas": [True, 0.9]}}, "training.adam_betas: Value error, both betas must be numbers"),
        ({"training": {"lr": float("inf")}}, "training.lr: Input should be a finite number"),
        ({"training": {"lr": float("nan")}}, "training.lr: Input should be a finite number"),
        ({"restart": {"max_backoff_s": float("inf")}}, "restart.max_backoff_s: Input should be a finite number"),
        ({"training": {"steps": True}}, "training.steps: Input should be a valid integer"),
        ({"training": {"steps": 2.0}}, "training.steps: Input should be a valid integer"),
        ({"data": {"prompts": "p.txt", "shuffle": "yes"}}, "data.shuffle: Input should be a valid boolean"),
        ({"generation": {"max_new_tokens": 10**9}}, "generation.max_new_tokens: Input should be less than or equal"),
        (
            {"generation": {"max_new_tokens": 200}},  # + max_prompt_tokens 128 > the random policy's 256 positions
            "data.max_prompt_tokens (128) + generation.max_new_tokens (200) = 328 exceeds "
            "policy.random_init.max_position_embeddings (256)",
        ),
        ({"algorithm": {"name": "dpo"}}, "algorithm.name: Input should be 'reinforce' or 'ppo'"),
        ({"algorithm": {"advantage_estimator": "gae"}}, "algorithm.advantage_estimator: Input should be 'rloo'"),
        ({"algorithm": {"name": "ppo", "gae_lambda": 1.5}}, "algorithm.gae_lambda: Input should be less than or equal"),
        ({"algorithm": {"name": "ppo", "num_minibatches": 3}}, "must be a multiple of algorithm.num_minibatches (3)"),
        (
            {"algorithm": {"name": "ppo"}, "training": {"backend": "megatron", "num_ranks": 2}},
            "ppo over several data-parallel ranks needs training.backend torch",
        ),
        ({"training": {"tensor_parallel": 2, "num_ranks": 2}}, "training.tensor_parallel > 1 needs training.backend"),
        (
            {"algorithm": {"name": "ppo"}, "training": {"backend": "megatron", "tensor_parallel": 2, "num_ranks": 4}},
            "training.num_ranks must equal training.tensor_parallel",
        ),
        (
            {"training": {"backend": "megatron", "tensor_parallel": 2, "num_ranks": 3}},
            "training.num_ranks (3) must be a multiple of training.tensor_parallel",
        ),
        ({"training": {"backend": "megatron", "pipeline_parallel": 2}}, "training.pipeline_parallel > 1 is not supp"),
        ({"critic": {"init": "reward_model"}}, "critic: Value error, init reward_model needs reward_model_path"),
        ({"critic": {"lr": -1}}, "critic.lr: Input should be greater than 0"),
        ({"critic": {"adam_betas": [2, -1]}}, "critic.adam_betas: Value error, each beta must be in [0, 1)"),
        (
            {"generation": {"engine": "sglang"}},
            "generation.engine: Input should be 'auto', 'torch', 'vllm' or 'tensorrt_llm'",
        ),
        ({"generation": {"dtype": "float16"}}, "generation.dtype: Input should be 'auto', 'float32' or 'bfloat16'"),
        (
            {"generation": {"engine": "tensorrt_llm"}, "training": {"lora": {}}},
            "training.lora sends adapter-only weight versions, which generation.engine tensorrt_llm does not load yet",
        ),
        (
            {"generation": {"engine": "vllm"}, "training": {"lora": {"rank": 513}}},
            "training.lora.rank 513: vLLM loads adapters up to rank 512",
        ),
        (
            {"algorithm": {"name": "ppo", "correct_engine_mismatch": True}},
            "algorithm.correct_engine_mismatch is reinforce's",
        ),
        ({"algorithm": {"name": "ppo", "policy_loss": "gspo"}}, "algorithm.policy_loss is reinforce's"),
        ({"algorithm": {"kl_clamp": 0}}, "algorithm.kl_clamp: Input should be greater than 0"),
        ({"algorithm": {"ratio_eps_low": 1.0}}, "algorithm.ratio_eps_low: Input should be less than 1"),
        ({"algorithm": {"ppo_loss_mask": "is_end"}}, "algorithm.ppo_loss_mask: Input should be 'ended' or 'all'"),
        (
            {"algorithm": {"dynamic_sampling": True, "max_policy_lag": 1}},
            "algorithm.dynamic_sampling needs algorithm.max_policy_lag 0 and one data-parallel rank",
        ),
        (
            {"algorithm": {"dynamic_sampling": True}, "training": {"num_ranks": 2}},
            "algorithm.dynamic_sampling needs algorithm.max_policy_lag 0 and one data-parallel rank",
        ),
        (
            {"algorithm": {"overlong_buffer": 64}, "generation": {"max_new_tokens": 48}},
            "algorithm.overlong_buffer (64) must not exceed generation.max_new_tokens (48)",
        ),
    ],
)
def test_bad_fields_are_named(patch, expected):
    data = {**MINIMAL, **patch}
    with pytest.raises(SpecError) as err:
        parse_spec(data, "run.yaml")
    assert expected in str(err.value)
    assert str(err.value).startswith("run.yaml: invalid run spec")


def test_yaml_spellings_of_the_old_surprises_are_refused(tmp_path):
    """The YAML a user writes, not only Python values: `.inf`, `true` for a count."""
    for text, field in (("training: {lr: .inf}", "training.lr"), ("training: {steps: true}", "training.steps")):
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(MINIMAL) + text + "\n")
        with pytest.raises(SpecError, match=field):
            load_spec(path)


def test_missing_required_section_is_named():
    with pytest.raises(SpecError, match=r"data: Field required"):
        parse_spec({"name": "t", "policy": {"random_init": {}}})


def test_unreadable_and_non_yaml_files_name_the_file(tmp_path):
    with pytest.raises(SpecError, match=r"nope\.yaml: cannot read"):
        load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match=r"bad\.yaml: not valid YAML"):
        load_spec(bad)
    bad.write_text("- a list\n")
    with pytest.raises(SpecError, match=r"bad\.yaml: a run spec must be a mapping"):
        load_spec(bad)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=12,
)
sections = st.sampled_from(["policy", "reward", "data", "algorithm", "generation", "training", "name", "seed"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(sections, json_values, max_size=6))
def test_fuzzed_specs_either_parse_or_raise_spec_error(data):
    try:
        assert isinstance(parse_spec({**MINIMAL, **data}), RunSpec)
    except SpecError as err:
        assert "invalid run spec" in str(err)


def test_a_loaded_policy_too_short_for_prompt_plus_response_is_refused_at_run_start(tmp_path):
    """Issue #13, finding 8: named by field before any process starts, not by a generator at sampling time."""
    from transformers import LlamaConfig

    from reinforce.supervisor.main import _check_fits_policy

    config = LlamaConfig(max_position_embeddings=64)
    spec = parse_spec({**MINIMAL, "policy": {"path": str(tmp_path / "policy")}, "data": {"prompts": "p.txt"}})
    with pytest.raises(SpecError) as err:
        _check_fits_policy(spec, Path("run.yaml"), config)
    assert str(err.value) == (
        "run.yaml: data.max_prompt_tokens (128) + generation.max_new_tokens (48) = 176 exceeds the policy's "
        "max_position_embeddings (64)"
    )
    short = spec.model_copy(update={"data": spec.data.model_copy(update={"max_prompt_tokens": 16})})
    _check_fits_policy(short, Path("run.yaml"), config)  # 16 + 48 fits


@pytest.mark.parametrize(
    ("engine", "algorithm", "dtype", "corrects"),
    [
        ("torch", {}, "float32", False),
        ("auto", {}, "float32", False),  # where no `reinforce run` chose (supervisor/engine_choice.py): torch
        ("vllm", {}, "bfloat16", True),
        ("tensorrt_llm", {}, "bfloat16", True),
        ("vllm", {"correct_engine_mismatch": False}, "bfloat16", False),
        ("torch", {"correct_engine_mismatch": True}, "float32", True),
        ("vllm", {"name": "ppo"}, "bfloat16", False),
    ],
)
def test_engine_defaults_resolve_by_engine(engine, algorithm, dtype, corrects):
    """`dtype`: where the machine has bfloat16 hardware; without, auto is float32 for every engine."""
    spec = parse_spec({**MINIMAL, "generation": {"engine": engine}, "algorithm": algorithm})
    assert spec.generation.resolved_dtype(bfloat16_native=True) == dtype
    assert spec.generation.resolved_dtype(bfloat16_native=False) == "float32"
    assert spec.corrects_engine_mismatch() is corrects
    for native in (True, False):
        named = parse_spec({**MINIMAL, "generation": {"engine": engine, "dtype": "float32"}}).generation
        assert named.resolved_dtype(native) == "float32"
        named = parse_spec({**MINIMAL, "generation": {"engine": engine, "dtype": "bfloat16"}}).generation
        assert named.resolved_dtype(native) == "bfloat16"


def test_lora_runs_on_the_vllm_engine():
    """Adapter-only weight versions load into vLLM's LoRA support: the pair is no longer refused."""
    spec = parse_spec({**MINIMAL, "generation": {"engine": "vllm"}, "training": {"lora": {"rank": 16}}})
    assert spec.training.lora.rank == 16 and spec.generation.engine == "vllm"


def test_ppo_runs_over_data_parallel_ranks_and_asynchronously():
    spec = parse_spec({**MINIMAL, "algorithm": {"name": "ppo", "max_policy_lag": 2}, "training": {"num_ranks": 2}})
    assert (spec.training.data_parallel, spec.algorithm.max_policy_lag) == (2, 2)


def test_clip_ranges_resolve_per_policy_loss():
    dapo = parse_spec({**MINIMAL, "algorithm": {"policy_loss": "clip", "ratio_eps_high": 0.28}})
    assert dapo.algorithm.clip_range() == (0.2, 0.28)
    gspo = parse_spec({**MINIMAL, "algorithm": {"policy_loss": "gspo"}})
    assert gspo.algorithm.clip_range() == (3e-4, 4e-4)
    assert parse_spec({**MINIMAL, "algorithm": {"kl_clamp": None}}).algorithm.kl_clamp is None


def test_the_generators_episodes_must_fit_the_environments_limit():
    """Each sample of a batch is an open episode; more than environment.max_episodes would be refused forever."""
    episodes = {"environment": {"enabled": True, "max_episodes": 64}, "generation": {"num_generators": 3}}
    with pytest.raises(SpecError, match=r"max_episodes \(64\) is below .* = 96"):
        parse_spec({**MINIMAL, **episodes})
    assert parse_spec({**MINIMAL, **episodes, "generation": {"num_generators": 2}}).environment.max_episodes == 64
