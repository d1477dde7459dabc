"""Parity (issue 44): one `forward_backward` + `optim_step` through the real `tinker` SDK against the served training
API equals the same batch computed in this process by an independent reference, to 1e-6 in float32, for
`cross_entropy` and `importance_sampling`.

The reference shares no code with the server: the base model is the server's own initial policy (its run folder's
initial_policy) loaded with transformers, the adapter PEFT's, drawn from the same seed as tenants.py draws it; the
loss is the SDK's definition written out here (a sum over tokens with the client's inputs), the gradient clipping
is written out by hand (torch's clip_grad_norm_ rule) and the step is torch's AdamW with the request's
hyperparameters. The server's adapter and AdamW moments are read with safetensors from its save_state checkpoints in
the run folder, before and after the step."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from conftest import stop_process
from safetensors.torch import load_file

from reinforce.core.names import LOCAL_HOST
from reinforce.supervisor.ports import free_port

tinker = pytest.importorskip("tinker", reason="the `api` extra (tinker==0.38.0) is not installed")
peft = pytest.importorskip("peft", reason="the `lora` extra (peft) is not installed")
from tinker import types  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEY = "tml-parity-test-key"
BASE_MODEL = "random_init"  # main.py's name of a random_init policy
RANK = 4
ALPHA = 8.0  # the spec's training.lora.alpha, not LoraSpec's default 16: the server must read it
# The SDK's defaults train_attn, train_mlp and train_unembed (tenants.py's module names for each)
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
# Datums of three lengths, so that the server's padded batch is compared with each datum computed alone.
TEXTS = ["the cat sat on the mat.", "a dog ran!", "hens lay eggs, do they?"]
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Server:
    url: str
    run_dir: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_server: str) -> Iterator[Server]:
    """`python -m reinforce.training_api` on examples/tiny.yaml's model with an untied output layer (so the SDK's
    default train_unembed=True adapts lm_head) and training.lora.alpha ALPHA."""
    folder = tmp_path_factory.mktemp("training-api-parity")
    spec = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    spec["run_dir"] = str(folder / "run")
    spec["data"]["prompts"] = str(ROOT / "examples" / spec["data"]["prompts"])
    spec["policy"]["random_init"]["tie_word_embeddings"] = False
    spec["training"]["lora"] = {"alpha": ALPHA}
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    port = free_port()
    env = {**os.environ, "REINFORCE_TRAINING_API_KEY": KEY}
    command = [sys.executable, "-m", "reinforce.training_api", "--spec", str(folder / "spec.yaml")]
    command += ["--port", str(port), "--redis-url", redis_server]
    with (folder / "api.log").open("w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{LOCAL_HOST}:{port}"
    try:
        wait_until_healthy(url, proc, folder / "api.log")
        yield Server(url, folder / "run")
    finally:
        stop_process(proc)


def wait_until_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/api/v1/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the training API did not answer within {timeout_s} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def service(server: Server) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    yield client
    client.close("success").result()


# ---- the batch --------------------------------------------------------------------------------------------------


def batch(tokenizer, loss_fn: str) -> list[types.Datum]:
    """TEXTS as next-token datums with per-token inputs that are not all equal, so that a server which dropped,
    averaged or misaligned one would compute another loss."""
    data = []
    for text in TEXTS:
        tokens = tokenizer.encode(text)
        n = len(tokens) - 1
        if loss_fn == "cross_entropy":
            # the first two targets as a prompt (weight 0), then weights of two sizes
            inputs = {"weights": [0.0, 0.0] + [1.0 if t % 2 else 0.5 for t in range(n - 2)]}
        else:
            # a sampler a little off the model (ratios around 1), advantages of both signs
            inputs = {
                "logprobs": [-3.4 + 0.05 * (t % 7) for t in range(n)],
                "advantages": [(1.0, -0.5, 0.25)[t % 3] for t in range(n)],
            }
        inputs["target_tokens"] = tokens[1:]
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return data


def inputs_of(datum: types.Datum, name: str) -> torch.Tensor:
    return datum.loss_fn_inputs[name].to_torch().reshape(-1)


# ---- the reference ----------------------------------------------------------------------------------------------


class Reference:
    """The server's model computed here: the base model loaded from the run folder and a PEFT adapter drawn from
    `seed` as tenants.py draws one (torch.manual_seed(seed), then PEFT's own initialisation: A random, B zero)."""

    def __init__(self, policy: Path, seed: int) -> None:
        base = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32, local_files_only=True).eval()
        config = peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=MODULES, bias="none", task_type="CAUSAL_LM"
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = peft.get_peft_model(base, config)
        # plain names (`<module>.lora_{A,B}.weight`, as the server's checkpoints name them) in sorted order
        self.parameters = {
            name.removeprefix(PEFT_PREFIX).replace(".default.", "."): p
            for name, p in sorted(self.model.named_parameters())
            if p.requires_grad
        }
        self.grad_norm = self.grad_rms = float("nan")

    def adapters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.parameters.items()}

    def target_logprobs(self, datum: types.Datum) -> torch.Tensor:
        """log p(target_t) at every position of one datum, computed alone (no padding)."""
        ids = torch.tensor([datum.model_input.to_ints()])
        logits = self.model(input_ids=ids, use_cache=False).logits[0].float()
        targets = inputs_of(datum, "target_tokens").long()
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)

    def forward_backward(self, data: list[types.Datum], loss_fn: str) -> tuple[float, list[torch.Tensor]]:
        """The SDK's loss summed over datums and tokens, its gradients accumulated; (loss, each datum's log-probs)."""
        loss = torch.zeros(())
        logprobs = []
        for datum in data:
            lp = self.target_logprobs(datum)
            if loss_fn == "cross_entropy":  # -sum_t w_t log p_t
                loss = loss - (inputs_of(datum, "weights") * lp).sum()
            else:  # importance_sampling: -sum_t exp(log p_t - log q_t) A_t
                ratio = torch.exp(lp - inputs_of(datum, "logprobs"))
                loss = loss - (ratio * inputs_of(datum, "advantages")).sum()
            logprobs.append(lp.detach())
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in self.parameters.values()])
        self.grad_norm = float(grads.double().norm())
        self.grad_rms = float(grads[grads != 0].double().pow(2).mean().sqrt())  # A's are 0: B starts at 0
        return float(loss.detach()), logprobs

    def optim_step(self, adam: types.AdamParams) -> torch.optim.AdamW:
        """Clip the global norm to grad_clip_norm (scale by max_norm / (norm + 1e-6) where under 1, the rule of
        torch's clip_grad_norm_; 0 does not clip), then one AdamW step with the request's hyperparameters."""
        if adam.grad_clip_norm > 0:
            scale = min(1.0, adam.grad_clip_norm / (self.grad_norm + 1e-6))
            for p in self.parameters.values():
                p.grad.mul_(scale)
        optimizer = torch.optim.AdamW(
            self.parameters.values(), lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
            weight_decay=adam.weight_decay,
        )  # fmt: skip
        optimizer.step()
        return optimizer


# ---- the server's checkpoints -----------------------------------------------------------------------------------


def checkpoint_folder(run_dir: Path, path: str) -> Path:
    """tinker://MODEL_ID/weights/NAME -> RUN_DIR/training_api/MODEL_ID/weights/NAME (checkpoint.py's layout)."""
    model_id, name = path.removeprefix("tinker://").split("/weights/")
    return run_dir / "training_api" / model_id / "weights" / name


def saved_adapters(run_dir: Path, path: str) -> dict[str, torch.Tensor]:
    return load_file(checkpoint_folder(run_dir, path) / "adapter.safetensors")


def saved_moments(run_dir: Path, path: str, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state by parameter name: the file numbers parameters in their sorted order, as `names` are."""
    flat = load_file(checkpoint_folder(run_dir, path) / "optimizer.safetensors")
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in flat.items():
        index, moment = key.split(".", 1)
        moments.setdefault(names[int(index)], {})[moment] = tensor
    return moments


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, what
    worst = (actual - expected).abs().max().item()
    assert worst <= 1e-6, f"{what}: differ by up to {worst:.3g}"


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(actual) == sorted(expected), what
    for name, tensor in expected.items():
        assert_close(actual[name], tensor, f"{what}, {name}")


# ---- the test ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("loss_fn", "seed"), [("cross_entropy", 11), ("importance_sampling", 12)])
def test_one_step_through_the_sdk_equals_the_reference(
    server: Server, service: tinker.ServiceClient, loss_fn: str, seed: int
):
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=seed).result()
    data = batch(training.get_tokenizer(), loss_fn)
    reference = Reference(server.run_dir / "initial_policy", seed)
    start = training.save_state(f"parity-{loss_fn}-before").result().path
    assert_same(saved_adapters(server.run_dir, start), reference.adapters(), "the adapters as created")

    expected_loss, expected_logprobs = reference.forward_backward(data, loss_fn)
    result = training.forward_backward(data, loss_fn).result()
    assert result.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-6, abs=1e-6)
    for index, (output, expected) in enumerate(zip(result.loss_fn_outputs, expected_logprobs, strict=True)):
        assert_close(output["logprobs"].to_torch(), expected, f"datum {index}'s target log-probs")

    # clipped at half the gradient's norm, so that the clip applies; eps at the clipped gradients' size, so that the
    # step depends on their size and not only on their sign (with eps 1e-12 AdamW's first step is about lr * sign)
    adam = types.AdamParams(
        learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=reference.grad_rms / 2, weight_decay=0.1,
        grad_clip_norm=reference.grad_norm / 2,
    )  # fmt: skip
    metrics = training.optim_step(adam).result().metrics
    optimizer = reference.optim_step(adam)
    assert metrics["grad_norm"] == pytest.approx(reference.grad_norm, rel=1e-6)

    after = training.save_state(f"parity-{loss_fn}-after").result().path
    assert_same(saved_adapters(server.run_dir, after), reference.adapters(), "the adapters after the step")
    names = list(reference.parameters)
    moments = saved_moments(server.run_dir, after, names)
    for moment in ("exp_avg", "exp_avg_sq"):  # exp_avg is (1 - beta1) times the clipped gradient itself
        expected = {n: optimizer.state[p][moment] for n, p in reference.parameters.items()}
        assert_same({n: moments[n][moment] for n in names}, expected, f"AdamW's {moment}")
