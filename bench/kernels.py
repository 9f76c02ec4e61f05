"""`rlpipe bench kernels`: the chunked log-prob path against whole logits, speed and peak memory."""

from __future__ import annotations

import json
import os
import time

import torch

from rlpipe.bench.common import in_fresh_process


# Output projections of real models: vocabulary -> hidden size (SmolLM2-135M, Qwen3-0.6B).
LOGPROB_BENCH_WIDTHS = {49152: 576, 151936: 1024}


def _logprob_run(vocab: int, width: int, tokens: int, impl: str, chunk: int, repeats: int, results) -> None:
    """In a fresh process, so that its peak resident memory belongs to this one implementation alone."""
    import resource

    from rlpipe.kernels import linear_logprob

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=generator).requires_grad_()
    weight = (0.02 * torch.randn(vocab, width, generator=generator)).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    upstream = torch.randn(tokens, generator=generator)

    def run() -> None:
        logprob, _ = linear_logprob(hidden, weight, targets, impl=impl, chunk=chunk)
        torch.autograd.grad((logprob * upstream).sum(), (hidden, weight))

    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    run()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    results.put({"seconds": best, "extra_bytes": max(0, peak - before)})


def bench_kernels(vocabs: list[int], tokens_list: list[int], chunk: int, repeats: int, out: str | None = None) -> list[dict]:
    """Log-probs through the output projection, forward and backward: the chunked path against whole logits
    (`reference`), each in its own process. Memory is the peak resident growth over the inputs."""
    rows = []
    for vocab in vocabs:
        width = LOGPROB_BENCH_WIDTHS.get(vocab, 1024)
        for tokens in tokens_list:
            logits_gb = tokens * vocab * 4 / 1e9
            print(f"vocab {vocab}, hidden {width}, {tokens} tokens (fp32 logits alone: {logits_gb:.2f} GB)", flush=True)
            measured = {
                impl: in_fresh_process(_logprob_run, vocab, width, tokens, impl, chunk, repeats)
                for impl in ("reference", "chunked")
            }
            base = measured["reference"]
            for impl, result in measured.items():
                row = {"vocab": vocab, "hidden": width, "tokens": tokens, "impl": impl, "chunk": chunk, **result,
                       "speed_vs_reference": base["seconds"] / result["seconds"],
                       "memory_vs_reference": result["extra_bytes"] / max(1, base["extra_bytes"])}
                rows.append(row)
                print(f"  {impl:>9}: {result['seconds']:6.2f} s ({row['speed_vs_reference']:.2f}x speed), "
                      f"peak +{result['extra_bytes'] / 1e9:5.2f} GB ({row['memory_vs_reference']:.1%} of reference)",
                      flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return rows
