"""The built-in tools recipes name as `rlpipe.tools:calculator` and `rlpipe.tools:python` (rlpipe.tools exports
them): arithmetic without running anything, and model-written Python run in the kernel sandbox
(rlpipe.usercode.sandbox), never in this process. Plain functions on TRL's tool contract; this module imports the
sandbox and nothing else of rlpipe, so a recipe's own module may build on it (`sandboxed_python`)."""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable

from rlpipe.usercode import sandbox

_ARITHMETIC = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % and parentheses.

    Args:
        expression: the expression, e.g. "(12 + 7) * 3"
    """

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            return _ARITHMETIC[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _ARITHMETIC:
            return _ARITHMETIC[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")  # no names, calls or powers: nothing runs

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    result = value(ast.parse(expression.strip(), mode="eval").body)
    return str(int(result) if float(result).is_integer() else round(result, 6))


# ---------------------------------------------------------------------------------------------- model-written code

PYTHON_LIMITS = sandbox.Limits(cpu_s=5, wall_s=10.0, memory_mb=512, processes=16, output_kb=16)
PYTHON_OUTPUT_CHARS = 1000  # of stdout and of the error each, in the tool message: it takes the episode's context
_SIGNALS = {  # how a program ended, by signal: SIGKILL is the sandbox's at its memory or CPU limit
    9: "was killed at its memory or CPU limit", 24: "ran out of CPU time", 11: "crashed (SIGSEGV)",
    6: "aborted (SIGABRT)",
}


class ProgramFailed(RuntimeError):
    """A sandboxed program that did not end well: the message is what the model is shown."""


def sandboxed_python(
    limits: sandbox.Limits = PYTHON_LIMITS, output_chars: int = PYTHON_OUTPUT_CHARS, isolated: bool = True
) -> Callable[[str], str]:
    """A tool named `python` that runs the model's program in the kernel sandbox (rlpipe.usercode.sandbox) with
    `limits`: a fresh interpreter per call with the standard library only, uid nobody, no network, no host files, a
    scratch /tmp, rlimits and a cgroup; at `limits.wall_s` its whole process tree is killed, so the call returns.
    It answers with stdout; a program that fails raises ProgramFailed (what it printed, then its error), which the
    model sees as {"error": ...}. `rlpipe.tools:python` is this with PYTHON_LIMITS; a module of one's own may hold
    another (`python = sandboxed_python(Limits(wall_s=5))`). `isolated=False` is the unsafe opt-out
    (rollout.unsafe_no_sandbox): a plain subprocess with the same rlimits."""

    def python(code: str) -> str:
        """Run a Python 3 program and return what it prints. Each call starts a fresh interpreter with the standard
        library only: no network, no files of earlier calls, limited time and memory. Print the values you need.

        Args:
            code: the program's source code, e.g. "print(sum(range(10)))"
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be a string, got {type(code).__name__}")
        outcome = sandbox.run(code, limits, isolated=isolated)
        stdout = _cut(outcome.stdout, output_chars, keep="head")
        if outcome.passed:
            return stdout
        if outcome.timed_out:
            error = f"the program did not finish within {limits.wall_s:g} s and was stopped"
        elif (signal := _killed_by(outcome.returncode, isolated)) is not None:
            how = _SIGNALS.get(signal, f"was killed by signal {signal}")
            error = f"the program {how}" + (f" ({limits.cpu_s} s allowed)" if signal == 24 else "")
        else:
            error = _cut(_program_traceback(outcome.stderr).strip(), output_chars, keep="tail")
            error = error or f"the program ended with exit status {outcome.returncode}"
        raise ProgramFailed(f"{stdout.rstrip()}\n{error}" if stdout.strip() else error)

    python.sandbox_limits = limits  # marks a tool that runs model-written code (sandboxed_tools)
    python.isolated = isolated
    python.without_sandbox = lambda: sandboxed_python(limits, output_chars, isolated=False)
    return python


python = sandboxed_python()


def _killed_by(returncode: int, isolated: bool) -> int | None:
    """The signal that ended the program: a subprocess's negative return code, or bwrap's 128 + signal."""
    if returncode < 0:
        return -returncode
    return returncode - 128 if isolated and returncode > 128 else None


_BOOT_FRAME = re.compile(r'  File "(<frozen runpy>"|<string>", line \d+, in <module>$)')


def _program_traceback(stderr: str) -> str:
    """`stderr` without the sandbox's start-up frames in its tracebacks (the interpreter's `-c` code and runpy, which
    run the program): the model sees the frames of its own program. Line by line, since the tracebacks of processes
    it forked may interleave."""
    return "\n".join(line for line in stderr.splitlines() if not _BOOT_FRAME.match(line))


def _cut(text: str, limit: int, keep: str) -> str:
    """`text` cut to `limit` characters, keeping its head or its tail, saying how much was left out."""
    if len(text) <= limit:
        return text
    left_out = f"[{len(text) - limit} characters left out]"
    return f"{text[:limit]}\n{left_out}" if keep == "head" else f"{left_out}\n{text[-limit:]}"
