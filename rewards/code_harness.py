"""The harness `rlpipe.rewards.code` runs in the sandbox: the tests in one process, the model's program in another.

Test side (`python main.py`): makes itself non-dumpable (so that no other process of the same uid can read its
memory or open its descriptors through /proc), reads the tests from descriptor 4 (the sandbox's private input,
which no other process inside holds) and closes it, then starts the program side. The tests run in a namespace of
their own: the task's own code from the prompt (its imports and helpers, run here from the dataset's text, never
the program's versions of them) and the entry point, a stub that calls the program's function in the program's
process. Only when every test held does it write `passed` to descriptor 3, the sandbox's report channel, which the
program's process never has.

Program side (`python main.py program R W`): runs program.py, sends the names it defined, then answers calls.
Arguments and results cross as marshal data (numbers, strings, bytes, lists, tuples, dicts, sets, None; a result
is checked to be only that on arrival), so the tests only ever see plain values: no object the program made runs
in the test process (an `__eq__` that always says yes is not a value). Whatever the program does to its own
interpreter (exits, patched builtins, a forged line on stdout) stays there. An exception the program raises crosses
as the built-in type, but never one that steers the tests' own code: StopIteration would end a `map` the tests
iterate as if it were exhausted (`all(map(candidate, xs))` holds then), so it, StopAsyncIteration, GeneratorExit,
SystemExit and KeyboardInterrupt arrive as ProgramControlFlowError, as PEP 479 turns a generator's StopIteration
into a RuntimeError, and the tests fail even where they catch it.

Kept to the standard library and to what the sandbox's interpreter (3.8 or later) has.
"""

import builtins
import ctypes
import json
import marshal
import os
import subprocess
import sys
import traceback

REPORT_FD = 3
INPUT_FD = 4
MAX_MESSAGE = 16 * 2**20


def send(fd, message):
    data = marshal.dumps(message)
    data = len(data).to_bytes(8, "little") + data
    while data:
        data = data[os.write(fd, data):]


def receive(fd):
    size = int.from_bytes(read_exactly(fd, 8), "little")
    if size > MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes from the program")
    return marshal.loads(read_exactly(fd, size))


def read_exactly(fd, size):
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("the program ended before answering")
        data += chunk
    return bytes(data)


def describe(error):
    return f"{type(error).__name__}: {error}"


def serve(requests, replies):
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "program.py"), encoding="utf-8") as file:
            exec(compile(file.read(), "program.py", "exec"), namespace)
    except BaseException as error:  # SystemExit too: a program that exits defines nothing
        send(replies, ("failed", describe(error)))
        return
    send(replies, ("defined", [name for name, value in namespace.items() if callable(value)]))
    while True:
        name, args, kwargs = receive(requests)
        try:
            reply = ("returned", namespace[name](*args, **kwargs))
            marshal.dumps(reply)
        except BaseException as error:
            if isinstance(error, ValueError) and "unmarshallable" in str(error):
                error = TypeError(f"{name} returned a value the tests cannot receive (only plain data crosses)")
            reply = ("raised", type(error).__name__, str(error))
        send(replies, reply)


PLAIN = (int, float, complex, str, bytes, bool, type(None), tuple, list, dict, set, frozenset)


def plain(value):
    """`value` if it holds plain data only; marshal can also make code objects, which the program's raw bytes on the
    reply pipe could ask for."""
    pending = [value]
    while pending:
        item = pending.pop()
        if type(item) not in PLAIN:
            raise TypeError(f"the program returned a {type(item).__name__}, not plain data")
        if isinstance(item, dict):
            pending += [*item.keys(), *item.values()]
        elif isinstance(item, (tuple, list, set, frozenset)):
            pending += item
    return value


CONTROL_FLOW = ("StopIteration", "StopAsyncIteration", "GeneratorExit", "SystemExit", "KeyboardInterrupt")
"""Exceptions that end an iteration or the interpreter rather than report an error: raised by the program, they
would pass for the tests' own control flow."""


class ProgramControlFlowError(RuntimeError):
    """The program raised one of CONTROL_FLOW; once seen, the tests have failed, whatever they catch."""


control_flow_seen = []


class Remote:
    """Stands in for a function of the program: calls it in the program's process, returns plain data."""

    def __init__(self, name, requests, replies):
        self.__name__ = name
        self._requests, self._replies = requests, replies

    def __call__(self, *args, **kwargs):
        send(self._requests, (self.__name__, args, kwargs))
        reply = receive(self._replies)
        if reply[0] == "returned":
            return plain(reply[1])
        _, kind, message = reply
        if kind in CONTROL_FLOW:
            control_flow_seen.append(kind)
            raise ProgramControlFlowError(f"{self.__name__} raised {kind}: {message}")
        error = getattr(builtins, kind, None)
        if isinstance(error, type) and issubclass(error, Exception):
            raise error(message)
        raise RuntimeError(f"{kind}: {message}")


def run_tests():
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0, before the tests are in this process's memory
    with os.fdopen(INPUT_FD, "rb") as spec_file:
        spec = json.loads(spec_file.read())
    requests_read, requests_write = os.pipe()
    replies_read, replies_write = os.pipe()
    program = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), "program", str(requests_read), str(replies_write)],
        pass_fds=(requests_read, replies_write),
        stdin=subprocess.DEVNULL,
    )  # close_fds: the program's process gets none of this one's descriptors but these two
    os.close(requests_read)
    os.close(replies_write)
    first = receive(replies_read)
    if first[0] != "defined":
        raise RuntimeError(f"the program failed: {first[1]}")
    defined = set(first[1])
    namespace = {"__name__": "__tests__"}
    exec(compile(spec.get("task_code", ""), "prompt.py", "exec"), namespace)
    entry_point = spec.get("entry_point")
    if entry_point:
        if entry_point not in defined:
            raise RuntimeError(f"the program defines no {entry_point}")
        namespace[entry_point] = Remote(entry_point, requests_write, replies_read)
    else:  # tests that name the program's functions: those that neither the task's code nor Python itself defines
        for name in defined - set(namespace) - set(dir(builtins)):
            namespace[name] = Remote(name, requests_write, replies_read)
    exec(compile(spec["test"], "tests.py", "exec"), namespace)
    if entry_point:
        namespace["check"](namespace[entry_point])
    if control_flow_seen:
        raise ProgramControlFlowError(f"the program raised {control_flow_seen[0]}, which the tests caught")
    os.write(REPORT_FD, b"passed")
    program.kill()


if __name__ == "__main__":
    if sys.argv[1:2] == ["program"]:
        serve(int(sys.argv[2]), int(sys.argv[3]))
    else:
        try:
            run_tests()
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
