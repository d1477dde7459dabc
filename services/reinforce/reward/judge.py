"""The program that judges a code_tests solution in the sandbox (reward/rewards.py sends this file's source).

Two processes, so that the solution never runs where its tests are judged:

- the judge (this program: the sandbox's main process) holds the tests, runs them, and its exit status is the
  verdict: 0 once the tests ran to their end;
- the solution's process (`serve`, started by the judge and given the solution only) runs the model's code and
  answers the judge's requests (its names, calls, attributes, items, iterations) over a pipe, as data.

What crosses from the solution becomes a plain value of a built-in type (None, bool, int, float, complex, str, bytes,
tuple, list, set, frozenset, dict), built by the judge, or else a `Remote` handle. A handle compares equal to no plain
value: an object whose `__eq__` is always True equals nothing the tests wrote (between two of the solution's own
objects its `__eq__` decides, as the tests asked). The solution cannot reach the verdict: it never sees the tests or
the judge's memory (the judge is not dumpable, so no ptrace and no /proc/PID/mem; the solution's process drops every
capability), and whatever it does to the judge (kill it, stop it, close the pipe, answer nonsense) fails the tests.
Builtins the solution redefines are not passed to the tests, and it can raise only the built-in exceptions that
derive from Exception there (never SystemExit).

What the tests cannot do here: pass a function of their own to the solution (a `key=` lambda), or use the solution's
classes as types (`isinstance(x, Stack)`, `except MyError`): only plain values and the solution's own objects cross.

Standard library only: it runs under the sandbox's system Python, where this package is not installed.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import operator
import os
import subprocess
import sys
import types
from typing import Any

PR_SET_DUMPABLE = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
PLAIN_SCALARS = (type(None), bool, int, float, str)
PLAIN_SEQUENCES = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
# The exceptions the judge re-raises by name; any other becomes SolutionError. Exception's subclasses only: a
# SystemExit(0) raised in the judge would end it with the status of tests that passed.
RAISABLE = {name: cls for name, cls in vars(builtins).items() if isinstance(cls, type) and issubclass(cls, Exception)}
BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_", "xor", "lshift", "rshift")
ORDER = ("lt", "le", "gt", "ge")
# Built-in conversions of one of the solution's objects, asked of its process, and the exact type each must answer.
CONVERSIONS = {"hash": int, "len": int, "bool": bool, "repr": str, "str": str, "int": int, "index": int, "float": float}


class SolutionError(Exception):
    """An exception the solution raised that is not a built-in one (its type's name and message)."""


def encode(value: Any, handle_of: Any) -> Any:
    """`value` as JSON: plain values by content, anything else as {"handle": handle_of(value)}."""
    kind = type(value)
    if kind in PLAIN_SCALARS:
        return value
    if kind in PLAIN_SEQUENCES.values():
        return {kind.__name__: [encode(item, handle_of) for item in value]}
    if kind is dict:
        return {"dict": [[encode(k, handle_of), encode(v, handle_of)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    return {"handle": handle_of(value)}


def decode(data: Any, object_of: Any) -> Any:
    """What `encode` made, built from the built-in types only; a handle is `object_of(number)`."""
    if type(data) in PLAIN_SCALARS:
        return data
    if type(data) is not dict or len(data) != 1:
        raise SolutionError(f"not a value: {data!r:.200}")
    [(tag, content)] = data.items()
    if tag in PLAIN_SEQUENCES:
        return PLAIN_SEQUENCES[tag](decode(item, object_of) for item in content)
    if tag == "dict":
        return {decode(k, object_of): decode(v, object_of) for k, v in content}
    if tag == "bytes":
        return bytes.fromhex(content)
    if tag == "complex":
        return complex(float(content[0]), float(content[1]))
    if tag == "handle" and type(content) is int:
        return object_of(content)
    raise SolutionError(f"not a value: {data!r:.200}")


# ---- the judge's side -------------------------------------------------------------------------------------------
class Channel:
    """Requests to the solution's process, one JSON line each way."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    def request(self, op: str, *args: Any) -> Any:
        line = json.dumps([op, *(encode(arg, self._handle_of) for arg in args)]) + "\n"
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line.encode())
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline() or "null")
        if type(answer) is not list or not answer:
            raise SolutionError("the solution's process ended or answered nonsense")
        if answer[0] == "ok" and len(answer) == 2:
            return decode(answer[1], lambda handle: Remote(self, handle))
        if answer[0] == "raise" and len(answer) == 3 and type(answer[1]) is str and type(answer[2]) is str:
            name, message = answer[1:]
            raise RAISABLE[name](message) if name in RAISABLE else SolutionError(f"{name}: {message}")
        raise SolutionError("the solution's process answered nonsense")

    @staticmethod
    def _handle_of(value: Any) -> int:
        if type(value) is Remote:
            return object.__getattribute__(value, "_handle")
        raise TypeError(f"the tests pass a {type(value).__name__} to the solution: only plain values and its objects")


class Remote:
    """One of the solution's objects, which lives in its process: every use of it is a request."""

    __slots__ = ("_channel", "_handle")

    def __init__(self, channel: Channel, handle: int) -> None:
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_handle", handle)

    def _ask(self, op: str, *args: Any) -> Any:
        return object.__getattribute__(self, "_channel").request(op, self, *args)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ask("call", list(args), kwargs)

    def __getattr__(self, name: str) -> Any:
        return self._ask("getattr", name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._ask("setattr", name, value)

    def __getitem__(self, key: Any) -> Any:
        return self._ask("getitem", key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._ask("setitem", key, value)

    def __iter__(self) -> Any:
        return self._ask("iter")

    def __next__(self) -> Any:
        return self._ask("next")

    def __eq__(self, other: object) -> bool:
        return type(other) is Remote and self._ask("compare", "eq", other) is True

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __contains__(self, item: Any) -> bool:
        return _exact(self._ask("contains", item), bool)

    def __neg__(self) -> Any:
        return self._ask("unary", "neg")

    def __abs__(self) -> Any:
        return self._ask("unary", "abs")


def _exact(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise TypeError(f"the solution answered a {type(value).__name__} where a {kind.__name__} is needed")
    return value


def _binary(name: str, reflected: bool) -> Any:
    def method(self: Remote, other: Any) -> Any:
        return self._ask("binary", name, other, reflected)

    return method


def _order(name: str) -> Any:
    def method(self: Remote, other: Any) -> Any:
        if type(other) is not Remote:  # a plain value is ordered with no object of the solution's
            raise TypeError(f"'{name}' between one of the solution's objects and a plain {type(other).__name__}")
        return _exact(self._ask("compare", name, other), bool)

    return method


def _conversion(name: str, kind: type) -> Any:
    def method(self: Remote) -> Any:
        return _exact(self._ask(name), kind)

    return method


for _name, _kind in CONVERSIONS.items():
    setattr(Remote, f"__{_name}__", _conversion(_name, _kind))
for _name in BINARY:
    _dunder = _name.rstrip("_")
    setattr(Remote, f"__{_dunder}__", _binary(_name, reflected=False))
    setattr(Remote, f"__r{_dunder}__", _binary(_name, reflected=True))
for _name in ORDER:
    setattr(Remote, f"__{_name}__", _order(_name))


def judge(solution: str, tests: str, source: str) -> None:
    """Run `tests` against `solution`, which runs in a process of its own (`source`: this file's text); returns
    once the tests ran to their end, else raises."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
    argv = [sys.executable, "-I", "-c", source + "\nserve()\n"]
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        channel = Channel(process)
        names = channel.request("load", solution)
        namespace: dict[str, Any] = {"__name__": "tests", "__builtins__": builtins}
        for name in names:
            if type(name) is str and name.isidentifier() and not hasattr(builtins, name):
                namespace[name] = channel.request("get", name)
        exec(compile(tests, "tests.py", "exec"), namespace)
    finally:
        process.kill()
        process.wait()


# ---- the solution's side ----------------------------------------------------------------------------------------
def _drop_capabilities() -> None:
    """No capability left (in a user namespace the call is its root): none to ptrace the judge with."""
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    ctypes.CDLL(None).capset(header, data)


def _answer(namespace: dict[str, Any], op: str, args: list[Any]) -> Any:
    if op == "load":
        exec(compile(args[0], "solution.py", "exec"), namespace)
        return [name for name in namespace if not name.startswith("__")]
    if op == "get":
        return namespace[args[0]]
    target, rest = args[0], args[1:]
    if op == "call":
        return target(*rest[0], **rest[1])
    if op == "getattr":
        return getattr(target, rest[0])
    if op == "setattr":
        return setattr(target, rest[0], rest[1])
    if op == "getitem":
        return target[rest[0]]
    if op == "setitem":
        target[rest[0]] = rest[1]
        return None
    if op == "binary":
        name, other, reflected = rest
        return getattr(operator, name)(*((other, target) if reflected else (target, other)))
    if op == "compare":
        return bool(getattr(operator, rest[0])(target, rest[1]))
    if op == "unary":
        return getattr(operator, rest[0])(target)
    if op == "contains":
        return rest[0] in target
    builtin = {"iter": iter, "next": next, "hash": hash, "len": len, "repr": repr, "index": operator.index}
    return builtin.get(op, CONVERSIONS.get(op))(target)


def serve() -> None:
    """The solution's process: requests on stdin, answers on stdout; the solution's own output goes nowhere."""
    _drop_capabilities()
    requests, answers = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    nowhere = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(nowhere, fd)
    objects: list[Any] = []
    module = types.ModuleType("solution")  # a real module: dataclasses and the like look their class's up
    sys.modules[module.__name__] = module
    namespace = module.__dict__

    def handle_of(value: Any) -> int:
        objects.append(value)
        return len(objects) - 1

    for line in requests:
        op, *encoded = json.loads(line)
        try:
            args = [decode(arg, objects.__getitem__) for arg in encoded]
            answer = json.dumps(["ok", encode(_answer(namespace, op, args), handle_of)])
        except Exception as err:  # every error of the solution's is the judge's to see
            answer = json.dumps(["raise", type(err).__name__, str(err)[:1000]])
        answers.write((answer + "\n").encode())
        answers.flush()
