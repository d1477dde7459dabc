"""Weight fan-out: time from publish to all-loaded for N generators, direct against relayed (generator/relay.py).

    sudo .venv/bin/python benchmarks/weight_fanout.py [--rate 200mbit] [--sizes 1 2 4 8 16] [--render]

Each receiver is a process in its own Linux network namespace, joined to a switch namespace by a veth pair whose
two ends are rate-limited with `tc ... tbf` (the node's uplink and downlink, --rate each); the trainer's WeightServer
sits in a namespace of its own behind the same kind of link. Traffic stays inside the namespaces this script makes
(10.77.0.0/24), which it removes at the end; it needs root. The payload is a safetensors file the size of
SmolLM2-135M in bfloat16 (269 MB, random tensors). A receiver runs the generator's weight code paths: direct is
`load_verified` from the trainer's endpoint, relay is `Relay.request` with the ancestors `plan_relay` gives (fan-out
--fanout) and `Relay.load`; "loaded" is the verified file read into tensors (safetensors `load_file`). The clock
starts once the version is published (file written, record made) and stops when the last receiver has loaded it.
"killed" is relay with the receiver in the middle of the chain SIGKILLed --kill-after seconds into the transfer:
its successors fall back to its predecessor and resume there; the time is the survivors'.
Writes benchmarks/results/weight_fanout.json and the section "Weight fan-out" of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import date
from pathlib import Path

from sections import write_section

REPO = Path(__file__).resolve().parent.parent

RESULTS = REPO / "benchmarks" / "results" / "weight_fanout.json"
HEADING = "## Weight fan-out"
PREFIX = "rkfan"  # namespaces rkfan-hub, rkfan-0 (trainer), rkfan-1..N; veth ends rkv-K (node) and rkb-K (switch)
SUBNET = "10.77.0"
PORT = 7000  # the trainer's endpoint and every relay, each at its own address
TOKEN = "fanout-benchmark-token"
SMOLLM2_BF16_PARAMETERS = 134_515_008  # SmolLM2-135M's parameters (examples/quickstart.yaml's policy)


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def address(node: int) -> str:
    return f"{SUBNET}.{node + 1}"


@contextmanager
def network(nodes: int, rate: str) -> object:
    """Namespaces 0 (trainer) .. nodes-1 on one switch, each link rate-limited both ways; removed afterwards."""
    hub = f"{PREFIX}-hub"
    teardown()
    try:
        sh("ip", "netns", "add", hub)
        sh("ip", "netns", "exec", hub, "ip", "link", "add", "br0", "type", "bridge")
        sh("ip", "netns", "exec", hub, "ip", "link", "set", "br0", "up")
        for node in range(nodes):
            ns, near, far = f"{PREFIX}-{node}", f"rkv-{node}", f"rkb-{node}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", near, "netns", ns, "type", "veth", "peer", "name", far, "netns", hub)
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address(node)}/24", "dev", near)
            for space, dev in ((ns, near), (hub, far)):
                sh("ip", "netns", "exec", space, "ip", "link", "set", dev, "up")
                # tbf: the link's rate; a burst of a few packets and a short queue, as a NIC's
                sh("ip", "netns", "exec", space, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", "64kb", "latency", "20ms")  # fmt: skip
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", hub, "ip", "link", "set", far, "master", "br0")
        yield
    finally:
        teardown()


def teardown() -> None:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listed:
        if name.startswith(f"{PREFIX}-"):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


# ---- the processes inside the namespaces ---------------------------------------------------------------------------
def trainer_main(folder: str, node: int) -> None:
    from reinforce.trainer.weight_server import WeightServer

    with WeightServer(Path(folder), host=address(node), port=PORT, token=TOKEN):
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.read()  # serve until the benchmark closes our stdin


def receiver_main(folder: str, node: int, trainer_dir: str, stall_s: float) -> None:
    """Wait for one request on stdin ({"record": WeightVersion JSON, "ancestors": [...] or null}), fetch and load it,
    answer {"loaded_at": unix time}, then keep relaying until stdin closes."""
    from google.protobuf.json_format import Parse
    from safetensors.torch import load_file

    from reinforce.core.records_pb2 import WeightVersion
    from reinforce.core.weights import WeightSources, load_verified
    from reinforce.generator.relay import Relay

    relay = Relay(Path(folder) / "relay", TOKEN, address(node), port=PORT, stall_s=stall_s)
    relay.start()
    print(json.dumps({"ready": True}), flush=True)
    request = json.loads(sys.stdin.readline())
    cpu_before = time.process_time()  # not the imports'
    record = Parse(request["record"], WeightVersion())
    sources = WeightSources(Path(trainer_dir), f"http://{address(0)}:{PORT}")

    def load(path: Path) -> None:
        load_file(path)  # the tensors into memory, dropped at once: what the load costs, not an engine's copy

    if request["ancestors"] is None:
        load_verified(load, record, sources, cache_dir=Path(folder) / "cache", token=TOKEN)
    else:
        relay.request(record, request["ancestors"])
        relay.load(load, record, sources)
    # its CPU seconds too: on a machine with few cores, N receivers' hashing and copying is the limit
    print(json.dumps({"loaded_at": time.time(), "cpu_s": time.process_time() - cpu_before}), flush=True)
    sys.stdin.read()
    relay.stop()


# ---- the benchmark -------------------------------------------------------------------------------------------------
def spawn(node: int, *args: str) -> subprocess.Popen[str]:
    argv = ["ip", "netns", "exec", f"{PREFIX}-{node}", sys.executable, __file__, *args, "--node", str(node)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    return proc


def wait_ready(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        line = proc.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError(f"a benchmark process did not start: {proc.args}")


def publish_payload(folder: Path, version: int) -> object:
    import torch

    from reinforce.core.weights import publish

    # SmolLM2-135M's size in bfloat16, in 30 tensors (its layer count): random values, as trained weights look to sha256
    per = SMOLLM2_BF16_PARAMETERS // 30
    gen = torch.Generator().manual_seed(version)
    tensors = {f"layer{i}": torch.randn(per, generator=gen).to(torch.bfloat16) for i in range(30)}
    tensors["rest"] = torch.zeros(SMOLLM2_BF16_PARAMETERS - 30 * per, dtype=torch.bfloat16)
    return publish(tensors, folder, version, keep=1, base_url=f"http://{address(0)}:{PORT}")


def run_once(mode: str, n: int, work: Path, version: int, args: argparse.Namespace) -> dict:
    """One publish to n receivers; the seconds from publish to the last (surviving) receiver's load."""
    from google.protobuf.json_format import MessageToJson

    from reinforce.core.rollout import plan_relay

    trainer_dir = work / "trainer"
    receivers = [
        spawn(node, "--role", "receiver", "--folder", str(work / f"r{node}"), "--trainer-dir", str(trainer_dir),
              "--stall-s", str(args.stall_s))
        for node in range(1, n + 1)
    ]  # fmt: skip
    try:
        wait_ready(receivers)
        record = publish_payload(trainer_dir, version)
        published_at = time.time()
        names = {str(node): f"http://{address(node)}:{PORT}" for node in range(1, n + 1)}
        plan = plan_relay(names, args.fanout) if mode != "direct" else {}
        for node, proc in enumerate(receivers, start=1):
            ancestors = plan.get(str(node)) if mode != "direct" else None
            proc.stdin.write(json.dumps({"record": MessageToJson(record, indent=None), "ancestors": ancestors}) + "\n")
            proc.stdin.flush()
        killed = None
        if mode == "killed":
            killed = receivers[n // 2 - 1] if n > 2 else receivers[0]
            time.sleep(args.kill_after)
            killed.kill()
        loaded, cpu = [], []
        for proc in receivers:
            if proc is killed:
                continue
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"receiver {proc.args} failed")
            loaded.append(json.loads(line)["loaded_at"] - published_at)
            cpu.append(json.loads(line)["cpu_s"])
        result = {"rate": args.rate, "mode": mode, "n": n, "seconds": max(loaded), "first_seconds": min(loaded),
                  "cpu_s": sum(cpu) / len(cpu), "bytes": record.num_bytes}  # fmt: skip
        return {**result, "kill_after_s": args.kill_after} if killed else result
    finally:
        for proc in receivers:
            if proc.poll() is None:
                proc.stdin.close()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()


def benchmark(args: argparse.Namespace) -> list[dict]:
    runs = []
    with tempfile.TemporaryDirectory(prefix="fanout-") as tmp, network(max(args.sizes) + 1, args.rate):
        work = Path(tmp)
        trainer = spawn(0, "--role", "trainer", "--folder", str(work / "trainer"))
        try:
            wait_ready([trainer])
            cases = [(mode, n) for n in args.sizes for mode in args.modes if mode != "killed"]
            cases += [("killed", n) for n in args.sizes if n >= 4 and "killed" in args.modes]
            for version, (mode, n) in enumerate(cases, start=1):
                result = run_once(mode, n, work, version, args)
                print(json.dumps(result), flush=True)
                runs.append(result)
        finally:
            trainer.stdin.close()
            trainer.wait(10)
    return runs


def merged(saved: dict, runs: list[dict], args: argparse.Namespace) -> dict:
    """The saved results with these runs replacing those of the same rate, mode and N (and their settings)."""
    new = {(r["rate"], r["mode"], r["n"]) for r in runs}
    kept = [r for r in saved.get("runs", []) if (r["rate"], r["mode"], r["n"]) not in new]
    return {
        "fanout": args.fanout, "stall_s": args.stall_s,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "date": date.today().isoformat(), "note": args.note or saved.get("note", ""), "runs": kept + runs,
    }  # fmt: skip


def render(results: dict) -> str:
    size_mb = results["runs"][0]["bytes"] / 1e6
    lines = [
        HEADING,
        "",
        "Generated by `sudo .venv/bin/python benchmarks/weight_fanout.py [--rate R] [--modes ...] [--sizes ...]` "
        "from `benchmarks/results/weight_fanout.json`. Each receiver in its own network namespace, every link (the "
        f"trainer's too) rate-limited to R each way (`tc tbf`); a {size_mb:.0f} MB safetensors file (SmolLM2-135M "
        f"in bfloat16); relay fan-out {results['fanout']} (a chain), relay_stall_s {results['stall_s']}. Seconds "
        "from publish to the last receiver's load (in brackets: the first's); CPU: a receiver's CPU seconds, mean. "
        "killed: relay with the receiver in the middle of the chain SIGKILLed K s into the transfer (the "
        f"survivors' time). {results['machine']}, {results['date']}. {results['note']}",
    ]
    for rate in sorted({r["rate"] for r in results["runs"]}, key=_bits):
        lines += _table(rate, {(r["mode"], r["n"]): r for r in results["runs"] if r["rate"] == rate})
    return "\n".join(lines) + "\n"


def _bits(rate: str) -> float:
    number = rate.rstrip("bitkmg")
    return float(number) * {"k": 1e3, "m": 1e6, "g": 1e9}.get(rate.removesuffix("bit")[-1:], 1)


def _table(rate: str, runs: dict) -> list[str]:
    one = runs.get(("relay", 1))
    ideal = runs[next(iter(runs))]["bytes"] * 8 / _bits(rate)
    lines = [
        "",
        f"{rate} per link (size / rate: {ideal:.1f} s):",
        "",
        "| N | direct | relay | relay / relay at N=1 | killed relay | CPU direct / relay |",
        "|---|---|---|---|---|---|",
    ]
    for n in sorted({n for _, n in runs}):
        cells = []
        for mode in ("direct", "relay"):
            r = runs.get((mode, n))
            cells.append(f"{r['seconds']:.1f} ({r['first_seconds']:.1f})" if r else "-")
        relay = runs.get(("relay", n))
        cells.append(f"{relay['seconds'] / one['seconds']:.2f}x" if relay and one else "-")
        killed = runs.get(("killed", n))
        cells.append(f"{killed['seconds']:.1f} (K = {killed['kill_after_s']:g})" if killed else "-")
        cpu = [f"{runs[(m, n)]['cpu_s']:.1f}" if "cpu_s" in runs.get((m, n), {}) else "-" for m in ("direct", "relay")]
        cells.append(" / ".join(cpu))
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["benchmark", "trainer", "receiver"], default="benchmark")
    parser.add_argument("--node", type=int, default=0)
    parser.add_argument("--folder", default="")
    parser.add_argument("--trainer-dir", default="")
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--rate", default="200mbit", help="each link's rate each way, as tc says it")
    parser.add_argument("--fanout", type=int, default=1)
    parser.add_argument(
        "--modes", nargs="+", choices=["direct", "relay", "killed"], default=["direct", "relay", "killed"]
    )
    parser.add_argument("--stall-s", type=float, default=10.0, help="relay_stall_s (the spec's default)")
    parser.add_argument("--kill-after", type=float, default=4.0, help="killed: seconds into the transfer")
    parser.add_argument("--note", default="", help="a line about the machine")
    parser.add_argument("--render", action="store_true", help="only re-render BENCHMARKS.md from the saved JSON")
    args = parser.parse_args()
    if args.role == "trainer":
        trainer_main(args.folder, args.node)
        return
    if args.role == "receiver":
        receiver_main(args.folder, args.node, args.trainer_dir, args.stall_s)
        return
    if not args.render:
        saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        RESULTS.write_text(json.dumps(merged(saved, benchmark(args), args), indent=1) + "\n")
    write_section(render(json.loads(RESULTS.read_text())))


if __name__ == "__main__":
    main()
