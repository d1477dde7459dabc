"""Environment service throughput: tool calls per second and step latency (p50, p99) of the calculator and the
sandboxed python tool at a few concurrency levels, against the real server process.

    python benchmarks/environment.py [--calls N] [--concurrency 1 4 16]

Starts `python -m reinforce.environment` on a free port (environment.max_concurrent_calls = the largest level), then
for each tool and level runs that many episodes at once, each stepping through its share of N calls (a step is one
HTTP request that runs one tool call). Latency is the client's: request to answer. Prints a table, saves
benchmarks/results/environment.json and writes the "Environment service" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from sections import add_render_flag, machine, render_saved, save_and_write

from reinforce.core.environment_client import EnvironmentClient
from reinforce.core.names import ENVIRONMENT_TOKEN_ENV, LOCAL_HOST
from reinforce.supervisor.ports import free_port

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "environment.json"
HEADING = "## Environment service"
TOKEN = "benchmark-token"
ACTIONS = {
    "calculator": '<tool_call>{"name": "calculator", "arguments": {"expression": "(12.5 * 4) ** 2 - 7"}}</tool_call>',
    "python": "```python\nprint(sum(i * i for i in range(1000)))\n```",
}


def start_server(work: Path, concurrency: int) -> tuple[subprocess.Popen[bytes], str]:
    spec = {
        "name": "env-bench",
        "run_dir": str(work / "run"),
        "policy": {"random_init": {}},
        "data": {"prompts": "p.txt"},
        "environment": {"enabled": True, "max_turns": 1_000_000, "max_concurrent_calls": concurrency},
    }
    spec_file = work / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    return start_environment(spec_file, work / "server.log")


def start_environment(spec_file: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The environment service on a free port, with the spec's tools and limits; its bearer token is TOKEN."""
    port = free_port()
    env = {**os.environ, ENVIRONMENT_TOKEN_ENV: TOKEN}
    argv = [sys.executable, "-m", "reinforce.environment", "--spec", str(spec_file), "--port", str(port)]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    url = f"http://{LOCAL_HOST}:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the environment service did not start: {log.read_text()}")


async def measure(url: str, action: str, calls: int, concurrency: int) -> dict:
    latencies: list[float] = []

    async def episode(client: EnvironmentClient, steps: int) -> None:
        start = await client.reset("benchmark")
        for _ in range(steps):
            began = time.perf_counter()
            result = await client.step(start.episode_id, action)
            latencies.append(time.perf_counter() - began)
            assert result.observation is not None and not result.observation.error, result
        await client.delete(start.episode_id)

    async with EnvironmentClient(url, TOKEN) as client:
        await episode(client, 3)  # warm-up: first imports, first sandbox
        latencies.clear()
        began = time.perf_counter()
        await asyncio.gather(*(episode(client, calls // concurrency) for _ in range(concurrency)))
        wall = time.perf_counter() - began
    ordered = sorted(latencies)
    return {
        "concurrency": concurrency,
        "calls": len(ordered),
        "calls_per_s": len(ordered) / wall,
        "p50_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
    }


def render(results: dict) -> str:
    m = results["machine"]
    lines = [
        HEADING,
        "",
        f"Written by `python benchmarks/environment.py` from `benchmarks/results/environment.json`. Machine: "
        f"{m['cpus']} CPUs (1-minute load average {m['load_average']:.1f} at the start: other work shared them), "
        f"Python {m['python']}, sandbox isolation {results['isolation']}. Measured {results['date']}.",
        "",
        "One step = one HTTP request that runs one tool call (client and server on the same machine). The python "
        "tool starts a confined process per call (unshare, a fresh interpreter, rlimits); the calculator evaluates "
        "in the service.",
        "",
        "| tool | concurrent episodes | calls | calls/s | p50 ms | p99 ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for tool, rows in results["tools"].items():
        for r in rows:
            lines.append(
                f"| {tool} | {r['concurrency']} | {r['calls']} | {r['calls_per_s']:.0f} | {r['p50_ms']:.1f} "
                f"| {r['p99_ms']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="tool calls per tool and concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    add_render_flag(parser)
    args = parser.parse_args()
    if args.render:
        return render_saved(RESULTS, render)
    load_average = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="env-bench-") as tmp:
        process, url = start_server(Path(tmp), max(args.concurrency))
        try:
            isolation = httpx.get(url + "/readyz").json()["isolation"]
            tools = {}
            for tool, action in ACTIONS.items():
                tools[tool] = [asyncio.run(measure(url, action, args.calls, c)) for c in args.concurrency]
                for row in tools[tool]:
                    print(tool, json.dumps(row))
        finally:
            process.terminate()
            process.wait(10)
    results = {"date": time.strftime("%Y-%m-%d"), "machine": machine(load_average), "isolation": isolation}
    save_and_write(RESULTS, {**results, "tools": tools}, render)


if __name__ == "__main__":
    main()
