"""Chat templates rendered within limits. A chat template is a program that comes with the model's files (Jinja, in
transformers' sandboxed environment, which keeps it from Python's internals but not from running for hours or
building huge strings: two nested loops over `range(100000)`, or `'x' * 10**10`). So templates render in a worker
process of their own, where each render gets RENDER_TIMEOUT_S and RENDER_MEMORY_BYTES, and returns at most
MAX_RENDERED_CHARS characters. Past a limit the worker is ended (the next render starts a fresh one) and the render
raises ChatTemplateError, one line, as it does for a template that fails.

The worker renders exactly as `tokenizer.apply_chat_template(..., tokenize=False)` does: the template that method
picks (`get_chat_template`), rendered by transformers' own `render_jinja_template` with the tokenizer's special
tokens and the call's keyword arguments. Requests go to it pickled (this process wrote them); answers come back as
JSON, which runs no code here whatever the worker was made to write. It imports transformers once (seconds) and ends
itself after IDLE_S without a request: prompts are rendered at start-up.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

# A real template renders a prompt in milliseconds; these are far past that and well within a machine's means.
RENDER_TIMEOUT_S = 10.0
RENDER_MEMORY_BYTES = 1 << 30  # address space a render may add to the worker's own
MAX_RENDERED_CHARS = 1 << 22  # about a million tokens: beyond any model's context
START_TIMEOUT_S = 180.0  # importing transformers on a busy machine
IDLE_S = 60.0
_EXIT_GRACE_S = 5.0  # from a worker's closing its pipes to its exit

_WORKER = r"""
import json, os, pickle, resource, sys
from multiprocessing.connection import Connection
requests, answers = Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
memory, max_chars, idle_s = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
def send(**answer):
    answers.send_bytes(json.dumps(answer).encode())
try:
    from transformers.utils.chat_template_utils import render_jinja_template
except Exception as err:
    send(error=f"the chat template's renderer cannot import transformers: {err}")
    sys.exit(1)
if os.path.exists("/proc/self/statm"):  # the address space it has now, plus what a render may add
    used = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (used + memory, used + memory))
send(ready=True)
while requests.poll(idle_s):
    try:
        request = pickle.loads(requests.recv_bytes())
    except EOFError:
        break
    try:
        (text,), _ = render_jinja_template(**request)
    except MemoryError:
        send(error=f"the chat template needs more than {memory >> 20} MiB to render a prompt")
    except RecursionError:
        send(error="the chat template fails on a prompt: it recurses without end")
    except Exception as err:
        send(error="the chat template fails on a prompt: " + (" ".join(str(err).split()) or type(err).__name__))
    else:
        if len(text) > max_chars:
            send(error=f"the chat template renders a prompt of {len(text)} characters, more than {max_chars}")
        else:
            send(text=text)
"""


class ChatTemplateError(ValueError):
    """A chat template that failed on a conversation or went past a limit; the message is one line."""


def render_chat(tokenizer, conversation: list[dict], tools: list[dict] | None = None, documents=None,
                chat_template: str | None = None, add_generation_prompt: bool = False,
                continue_final_message: bool | str = False, **kwargs) -> str:
    """`tokenizer.apply_chat_template(conversation, ..., tokenize=False)` for one conversation, rendered by the worker
    within the limits; `tools` as JSON schemas. Raises ChatTemplateError."""
    request = pickle.dumps({
        "conversations": [conversation], "tools": tools, "documents": documents,
        "chat_template": tokenizer.get_chat_template(chat_template, tools),
        "add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
        **tokenizer.special_tokens_map, **kwargs,  # as apply_chat_template: the call's own win
    })
    with _lock:
        return _render(request)


_lock = threading.Lock()
_worker: _Worker | None = None


def start_renderer() -> None:
    """Start the worker without waiting for it: its import of transformers then overlaps the caller's own start-up
    (a run's checks before its first render)."""
    global _worker
    with _lock:
        if _worker is None:
            _worker = _Worker()


def _render(request: bytes) -> str:
    global _worker
    for attempt in range(2):
        if _worker is not None and not _worker.alive():  # ended itself while idle
            _worker.close()
            _worker = None
        if _worker is None:
            _worker = _Worker()
        try:
            answer = _worker.ask(request)
        except BaseException:
            _worker.close()
            _worker = None
            raise
        if answer is not None:
            break
        status = _worker.close(grace_s=_EXIT_GRACE_S)
        _worker = None
        if status != 0 or attempt:  # 0: it ended itself while idle, just as the request came; once more, anew
            raise ChatTemplateError(f"the chat template's renderer ended while rendering a prompt (exit status "
                                    f"{status})")
    if "error" in answer:
        raise ChatTemplateError(answer["error"])
    return answer["text"]


class _Worker:
    """The process that renders, and the two pipes to it."""

    def __init__(self):
        request_read, request_write = os.pipe()
        answer_read, answer_write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-c", _WORKER, str(request_read), str(answer_write), str(RENDER_MEMORY_BYTES),
                 str(MAX_RENDERED_CHARS), str(IDLE_S)],
                pass_fds=(request_read, answer_write), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (request_write, answer_read):
                os.close(fd)
            raise
        finally:
            os.close(request_read)
            os.close(answer_write)
        self.requests = Connection(request_write, readable=False)
        self.answers = Connection(answer_read, writable=False)
        self.started = False

    def wait_started(self) -> None:
        """Wait for the worker's word that it is ready; raises ChatTemplateError when it could not start."""
        if self.started:
            return
        try:
            started = self._answer(START_TIMEOUT_S)
        except TimeoutError:
            started = {"error": f"the chat template's renderer did not start within {START_TIMEOUT_S:g} s"}
        if started is None or "error" in started:
            self.close()
            raise ChatTemplateError((started or {}).get("error") or "the chat template's renderer ended as it started")
        self.started = True

    def alive(self) -> bool:
        return self.process.poll() is None

    def ask(self, request: bytes) -> dict | None:
        """The worker's answer; None when it had ended (its pipes closed)."""
        self.wait_started()
        try:
            self.requests.send_bytes(request)
        except OSError:  # BrokenPipeError: it ended
            return None
        try:
            return self._answer(RENDER_TIMEOUT_S)
        except TimeoutError:
            raise ChatTemplateError(f"the chat template did not render a prompt within {RENDER_TIMEOUT_S:g} s") from None

    def _answer(self, timeout_s: float) -> dict | None:
        """The next answer; None when the worker ended. Raises TimeoutError past `timeout_s`."""
        if not self.answers.poll(timeout_s):
            raise TimeoutError
        try:
            # At most 12 bytes a character: JSON writes one outside the BMP as two \u escapes.
            return json.loads(self.answers.recv_bytes(MAX_RENDERED_CHARS * 12 + 1024))
        except (EOFError, OSError):
            return None

    def close(self, grace_s: float = 0.0) -> int:
        """End the worker, after `grace_s` for it to end by itself; its exit status."""
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
        status = self.process.wait()
        self.requests.close()
        self.answers.close()
        return status


@atexit.register
def _close_worker() -> None:
    if _worker is not None:
        _worker.close()
