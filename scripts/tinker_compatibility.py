"""Every public method of the `tinker` SDK's ServiceClient, TrainingClient, SamplingClient and RestClient, called
against the real training API: which ones it supports and which it refuses (at once, naming the method).

    python scripts/tinker_compatibility.py      # serves examples/tiny.yaml, calls them all, writes the table

The table is docs/training-api.md's block `compatibility`; tests/integration/test_training_api_compatibility.py
calls them all again and fails if the table differs, if a method is left out, if a call hangs, or if a refusal does
not name what it refuses. A method's `_async` twin is called too (awaited), with the same arguments. "supported"
means it returned; "refused by the server" gives the status and the first sentence of its answer, "refused by the SDK"
the SDK's own check that stopped the call before it sent anything.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as CallTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

# The SDK's SamplingClient.get_tokenizer looks its base model's name up on the Hub; offline, huggingface_hub would
# retry for about 25 s before it gives up. Set before tinker (and so huggingface_hub) is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tinker
import yaml
from tinker import types

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "training-api.md"
BLOCK = re.compile(r"(<!-- generated:compatibility -->\n)(?:.*?\n)?(<!-- end:compatibility -->)", re.S)
EXPORTS = re.compile(r"^export TINKER_BASE_URL=(?P<url>\S+)\nexport TINKER_API_KEY=(?P<key>\S+)$", re.M)
CALL_TIMEOUT_S = 60.0  # a call that has neither returned nor raised by then hangs (the SDK retries some for minutes)
CLIENTS = (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient)
BASE_MODEL = "random_init"  # examples/tiny.yaml's policy
MISSING = "tinker://no-such-run/weights/none"
# Public methods that send no request of their own, and why they are not called.
NOT_CALLED = {
    ("SamplingClient", "create"): "the SDK's own constructor, which create_sampling_client calls",
    ("SamplingClient", "on_queue_state_change"): "the SDK's callback for its own request queue",
}


@dataclass(frozen=True)
class Row:
    client: str
    method: str
    outcome: str  # "supported", "refused by the server (STATUS): ...", "refused by the SDK: ...", "hangs", "not called"

    @property
    def answered(self) -> bool:
        """Supported; refused by the server naming what it refuses (the method, its client or the route); refused
        by the SDK before it sent anything; or not a request. Never a hang."""
        if self.outcome == "supported" or self.outcome.startswith(("not called", "refused by the SDK")):
            return True
        words = (self.method.removesuffix("_async"), self.client, "no such")
        return self.outcome.startswith("refused by the server") and any(w in self.outcome for w in words)


# (object, args, kwargs) for a method; the object and the arguments are made when it is called.
Recipe = Callable[[], tuple[Any, tuple, dict]]


class Clients:
    """The clients the calls need, made with supported calls, and the arguments that make sense for each method."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key, self.names = url, key, count()
        self.service = tinker.ServiceClient(base_url=url, api_key=key)
        self.rest = self.service.create_rest_client()
        self.training = self.service.create_lora_training_client(
            base_model=BASE_MODEL, rank=2, seed=1, train_unembed=False
        ).result()
        tokens = self.training.get_tokenizer().encode("the cat sat on the mat.")
        self.prompt = types.ModelInput.from_ints(tokens[:4])
        self.datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        self.state = self.training.save_state(self.name()).result().path
        self.external = f"tinker://{self.training.model_id}/external_weights/none"  # the only kind the SDK sends
        self._sampling: tinker.SamplingClient | None = None

    def name(self) -> str:
        return f"compatibility-{next(self.names)}"

    def sampling(self) -> tinker.SamplingClient:
        if self._sampling is None:
            self._sampling = self.training.save_weights_and_get_sampling_client().result()
        return self._sampling

    def other_service(self, **kwargs: Any) -> tinker.ServiceClient:
        """A client of its own: for `close` (closing the one the other calls use would end their session), and for
        a project (copy_weights asks for one)."""
        return tinker.ServiceClient(base_url=self.url, api_key=self.key, **kwargs)

    def session_id(self) -> str:
        return self.service.holder.get_session_id()

    def recipes(self) -> dict[tuple[str, str], Recipe]:
        s, t, r = self.service, self.training, self.rest
        adam = types.AdamParams(learning_rate=1e-3)
        return {
            ("ServiceClient", "close"): lambda: (self.other_service(), ("success",), {}),
            ("ServiceClient", "copy_weights"): lambda: (self.other_service(project_id="project"), (self.state,), {}),
            ("ServiceClient", "create_custom_loss"): lambda: (s, (summed_logprobs_per_datum, {"logprobs": 1}), {}),
            ("ServiceClient", "create_lora_training_client"): lambda: (
                s,
                (),
                {"base_model": BASE_MODEL, "rank": 2, "train_unembed": False},
            ),
            ("ServiceClient", "create_rest_client"): lambda: (s, (), {}),
            ("ServiceClient", "create_sampling_client"): lambda: (s, (), {"base_model": BASE_MODEL}),
            ("ServiceClient", "create_training_client_from_state"): lambda: (s, (self.state,), {}),
            ("ServiceClient", "create_training_client_from_state_with_optimizer"): lambda: (s, (self.state,), {}),
            ("ServiceClient", "get_console_url"): lambda: (s, (), {}),
            ("ServiceClient", "get_server_capabilities"): lambda: (s, (), {}),
            ("ServiceClient", "get_telemetry"): lambda: (s, (), {}),
            ("TrainingClient", "create_sampling_client"): lambda: (
                t,
                (t.save_weights_for_sampler(self.name()).result().path,),
                {},
            ),
            ("TrainingClient", "forward"): lambda: (t, ([self.datum], "cross_entropy"), {}),
            ("TrainingClient", "forward_backward"): lambda: (t, ([self.datum], "cross_entropy"), {}),
            ("TrainingClient", "forward_backward_custom"): lambda: (t, ([self.datum], summed_logprobs), {}),
            ("TrainingClient", "get_console_url"): lambda: (t, (), {}),
            ("TrainingClient", "get_info"): lambda: (t, (), {}),
            ("TrainingClient", "get_telemetry"): lambda: (t, (), {}),
            ("TrainingClient", "get_tokenizer"): lambda: (t, (), {}),
            ("TrainingClient", "load_state"): lambda: (t, (self.state,), {}),
            ("TrainingClient", "load_state_with_optimizer"): lambda: (t, (self.state,), {}),
            ("TrainingClient", "optim_step"): lambda: (t, (adam,), {}),
            ("TrainingClient", "save_state"): lambda: (t, (self.name(),), {}),
            ("TrainingClient", "save_weights_and_get_sampling_client"): lambda: (t, (), {}),
            ("TrainingClient", "save_weights_external"): lambda: (t, (self.name(),), {}),
            ("TrainingClient", "save_weights_for_sampler"): lambda: (t, (self.name(),), {}),
            ("SamplingClient", "compute_logprobs"): lambda: (self.sampling(), (self.prompt,), {}),
            ("SamplingClient", "from_sampler_handle"): lambda: (
                tinker.SamplingClient,
                (self.sampling().get_sampler_handle(),),
                {"api_key": self.key},
            ),
            ("SamplingClient", "get_base_model"): lambda: (self.sampling(), (), {}),
            ("SamplingClient", "get_sampler_handle"): lambda: (self.sampling(), (), {}),
            ("SamplingClient", "get_telemetry"): lambda: (self.sampling(), (), {}),
            ("SamplingClient", "get_tokenizer"): lambda: (self.sampling(), (), {}),
            ("SamplingClient", "sample"): lambda: (
                self.sampling(),
                (self.prompt, 2, types.SamplingParams(max_tokens=4, seed=1)),
                {},
            ),
            ("RestClient", "assign_session_project"): lambda: (r, (self.session_id(), "project"), {}),
            ("RestClient", "copy_weights"): lambda: (r, (self.state, "project"), {}),
            ("RestClient", "delete_checkpoint"): lambda: (r, (t.model_id, "weights/none"), {}),
            ("RestClient", "delete_checkpoint_from_tinker_path"): lambda: (r, (MISSING,), {}),
            ("RestClient", "export_session_trace"): lambda: (r, (self.session_id(),), {}),
            ("RestClient", "get_audit_log"): lambda: (r, (), {}),
            ("RestClient", "get_billing_usage"): lambda: (r, ("2026-01-01", "2026-02-01"), {}),
            ("RestClient", "get_current_checkpoint_storage_usage"): lambda: (r, (), {}),
            ("RestClient", "get_external_weights_urls"): lambda: (r, (self.external,), {}),
            ("RestClient", "get_sampler"): lambda: (r, (self.sampling()._sampling_session_id,), {}),  # no public name
            ("RestClient", "get_server_capabilities"): lambda: (r, (), {}),
            ("RestClient", "get_session"): lambda: (r, (self.session_id(),), {}),
            ("RestClient", "get_telemetry"): lambda: (r, (), {}),
            ("RestClient", "get_training_run"): lambda: (r, (t.model_id,), {}),
            ("RestClient", "get_training_run_by_tinker_path"): lambda: (r, (self.state,), {}),
            ("RestClient", "get_weights_info_by_tinker_path"): lambda: (r, (self.state,), {}),
            ("RestClient", "list_checkpoints"): lambda: (r, (t.model_id,), {}),
            ("RestClient", "list_sessions"): lambda: (r, (), {}),
            ("RestClient", "list_training_runs"): lambda: (r, (), {}),
            ("RestClient", "list_user_checkpoints"): lambda: (r, (), {}),
            ("RestClient", "publish_checkpoint_from_tinker_path"): lambda: (r, (self.state,), {}),
            ("RestClient", "search_sessions"): lambda: (r, (types.SessionSearchRequest(),), {}),
            ("RestClient", "set_checkpoint_ttl_from_tinker_path"): lambda: (r, (self.state, 3600), {}),
            ("RestClient", "unpublish_checkpoint_from_tinker_path"): lambda: (r, (self.state,), {}),
            ("RestClient", "whoami"): lambda: (r, (), {}),
        }


def summed_logprobs(_data: list, logprobs: list) -> tuple:
    """A custom loss for forward_backward_custom: minus the summed log-probabilities (cross-entropy's, client-side)."""
    return -sum(lp.sum() for lp in logprobs), {}


def summed_logprobs_per_datum(logprobs: Any) -> Any:
    """A server-side custom loss (create_custom_loss): minus the datum's summed log-probabilities."""
    return -logprobs.sum()


def public_methods() -> list[tuple[str, str]]:
    """Every public method of the four clients, as the installed SDK has them."""
    return [(cls.__name__, name) for cls in CLIENTS for name, member in inspect.getmembers(cls)
            if not name.startswith("_") and callable(member)]  # fmt: skip


def call(recipe: Recipe, method: str) -> Any:
    """The method called and its answer awaited: a future's result, or an `_async` twin's coroutine and result."""
    target, args, kwargs = recipe()
    if method.endswith("_async"):
        return asyncio.run(_awaited(getattr(target, method)(*args, **kwargs)))
    answer = getattr(target, method)(*args, **kwargs)
    return answer.result() if hasattr(answer, "result") else answer


async def _awaited(coroutine: Any) -> Any:
    answer = await coroutine
    return await answer.result_async() if hasattr(answer, "result_async") else answer


def outcome(recipe: Recipe, method: str, pool: ThreadPoolExecutor) -> str:
    future = pool.submit(call, recipe, method)
    try:
        future.result(CALL_TIMEOUT_S)
    except CallTimeout:
        return "hangs"
    except tinker.APIStatusError as err:  # the server's answer
        return f"refused by the server ({err.status_code}): {detail_of(err)}"
    except Exception as err:  # the SDK's own check, before it sent anything
        return f"refused by the SDK: {first_sentence(str(err) or type(err).__name__)}"
    return "supported"


def detail_of(err: Any) -> str:
    body = err.body if isinstance(err.body, dict) else {}
    return first_sentence(str(body.get("detail", err.message)))


def first_sentence(text: str) -> str:
    """Up to the first full stop, a session's random id written SESSION (the table must not change run to run)."""
    text = re.sub(r"session-[0-9a-f]{32}", "SESSION", text.strip().splitlines()[0])
    return text.split(". ")[0].removesuffix(".")


def measure(url: str, key: str) -> list[Row]:
    """Every public method called once against the API at `url` (one by one, in the table's order)."""
    clients = Clients(url, key)
    recipes = clients.recipes()
    rows = []
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="compatibility") as pool:
        for client, method in public_methods():
            if (client, method) in NOT_CALLED:
                rows.append(Row(client, method, f"not called: {NOT_CALLED[client, method]}"))
                continue
            recipe = recipes.get((client, method.removesuffix("_async")))
            if recipe is None:
                raise SystemExit(f"{client}.{method}: no call written for it (tinker {tinker.__version__}?)")
            rows.append(Row(client, method, outcome(recipe, method, pool)))
    return rows


def render(rows: list[Row]) -> str:
    lines = [f"Measured against tinker {tinker.__version__} by `python scripts/tinker_compatibility.py`.", "",
             "| client | method | outcome |", "| --- | --- | --- |"]  # fmt: skip
    for row in rows:
        lines.append(f"| {row.client} | `{row.method}` | {row.outcome.replace('|', '/')} |")
    return "\n".join(lines)


def write(rows: list[Row]) -> None:
    text = PAGE.read_text()
    if not BLOCK.search(text):
        raise SystemExit(f"{PAGE} lacks the markers of the generated block 'compatibility'")
    PAGE.write_text(BLOCK.sub(lambda m: m.group(1) + render(rows) + "\n" + m.group(2), text))


def committed_table() -> str:
    found = BLOCK.search(PAGE.read_text())
    return found.group(0).split("\n", 1)[1].rsplit("\n", 1)[0] if found else ""


def tiny_spec(folder: Path) -> dict:
    """examples/tiny.yaml with its run folder in `folder` (and its prompts found from anywhere)."""
    spec = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    spec["run_dir"] = str(folder / "run")
    spec["data"]["prompts"] = str(ROOT / "examples" / spec["data"]["prompts"])
    return spec


@contextmanager
def served(spec: dict, folder: Path, wait_s: float = 300.0) -> Iterator[tuple[str, str]]:
    """`reinforce serve` of `spec` (written to `folder`): its URL and API key as it prints them, until Ctrl-C at the
    end (benchmarks/training_api.py serves through it too)."""
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    argv = [sys.executable, "-m", "reinforce", "serve", str(folder / "spec.yaml")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    printed, found = [], threading.Event()

    def read() -> None:
        for line in proc.stdout:
            printed.append(line)
            if EXPORTS.search("".join(printed)):
                found.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not found.wait(wait_s):
            raise RuntimeError(f"reinforce serve printed no TINKER_BASE_URL:\n{''.join(printed)}")
        exports = EXPORTS.search("".join(printed))
        yield exports["url"], exports["key"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="tinker-compatibility-") as tmp:
        folder = Path(tmp)
        with served(tiny_spec(folder), folder) as (url, key):
            rows = measure(url, key)
    write(rows)
    print(render(rows))


if __name__ == "__main__":
    main()
