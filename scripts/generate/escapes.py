"""The escape suite's table in docs/environments.md, from its one source: each probe of
tests/integration/test_environment.py (the test `test_escape_<name>`, run by its `sandboxed` fixture against every
isolation mode the environment service offers), what it tries, how it is judged from outside the sandbox, and the
modes where it has nothing to try. The tests skip a probe exactly where `Probe.not_in` says so, with its reason."""

from __future__ import annotations

from dataclasses import dataclass, field

# The `sandboxed` fixture's parameters: the service as each isolation mode runs it.
MODES = {
    "process": "`namespaces`: the local service as root",
    "unprivileged": "`user_namespaces`: the local service as a user without privileges",
    "container": "`none`: docker-compose's environment container, confined as the operator's pod",
}


@dataclass(frozen=True)
class Probe:
    tries: str
    judged: str  # what the test checks from outside the sandbox
    not_in: dict[str, str] = field(default_factory=dict)  # mode -> why there is nothing to try there


PROBES = {
    "network": Probe(
        "connect to a listener on every address of the machine",
        "the listener accepted nothing; the call saw no interface but loopback",
    ),
    "write_outside_scratch": Probe(
        "write a file of the test's, the image's folders and `/tmp` outside its scratch folder",
        "no file appeared outside; every write but the scratch folder's was refused",
    ),
    "symlinks": Probe(
        "write and read through symbolic links from its scratch folder to a file of the test's",
        "the test's file is unchanged and its content was not read",
    ),
    "read_the_parents_environment_and_run_folder": Probe(
        "read every `/proc/*/environ` and the run folder",
        "neither the service's secrets nor the run's files reached the call",
    ),
    "replace_the_api_socket": Probe(
        "remove, rename or shadow the service's Unix socket",
        "the socket is the service's and answers",
        {mode: "the local service listens on TCP: there is no socket file" for mode in ("process", "unprivileged")},
    ),
    "fork_bomb": Probe("fork without end", "the call was stopped and the next call runs"),
    "signals_to_the_service": Probe(
        "every signal that ends a process, to its parent and to PID 1",
        "the service still answers (in the container: running, never restarted)",
    ),
    "memory_bomb": Probe("allocate 1 GiB under a 256 MB limit", "MemoryError, and the service lives"),
    "memory_spread_over_processes": Probe(
        "hold the limit's memory in several processes at once",
        "the call was stopped within a poll and says its memory limit was exceeded",
    ),
    "disk_bomb": Probe(
        "fill its scratch folder past `file_limit_mb`",
        "the writes were refused at the limit, and the next call's folder is empty",
    ),
    "another_calls_files_and_files_left_behind": Probe(
        "read another live call's files, and find what an earlier call left in `/tmp`, `/var/tmp` and `/dev/shm`",
        "neither was found",
    ),
    "infinite_loop": Probe("loop without end", "killed at the time limit"),
    "100_mb_print": Probe("print 100 MB", "the answer is cut to the output limit; the service's memory stayed low"),
    "shared_memory_left_behind": Probe(
        "leave a 64 MB System V shared memory segment", "no later call, nor the machine, finds it"
    ),
    "a_process_left_behind": Probe(
        "leave a daemon behind",
        "no process of the call is left once it answered",
        {"unprivileged": "its pid is its namespace's and its uid the service's: nothing outside can find it by"},
    ),
}


def escapes_markdown() -> str:
    lines = [
        "| probe: the call tries to | judged from outside | " + " | ".join(MODES.values()) + " |",
        "| --- | --- | " + " | ".join("---" for _ in MODES) + " |",
    ]
    for name, probe in PROBES.items():
        cells = [f"n/a: {probe.not_in[mode]}" if mode in probe.not_in else "contained" for mode in MODES]
        lines.append(f"| `{name}`: {probe.tries} | {probe.judged} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
