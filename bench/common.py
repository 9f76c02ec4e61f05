"""Helpers the benchmarks share: running one measurement in a fresh process."""

from __future__ import annotations

import queue as queue_module


def in_fresh_process(target, *args):
    """`target(*args, results)` in a spawned process; returns what it put on `results`. A fresh process per
    measurement keeps peak memory (and vLLM engines) from one measurement out of the next."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=target, args=(*args, results))
    child.start()
    while True:
        try:
            result = results.get(timeout=5)
            break
        except queue_module.Empty:
            # A child that dies without reporting (a crash in native code) would leave us waiting forever.
            if child.exitcode is not None:
                try:  # it may have reported just before exiting
                    result = results.get(timeout=1)
                    break
                except queue_module.Empty:
                    raise RuntimeError(f"{target.__name__} exited with code {child.exitcode} without a result") from None
    child.join()
    return result
