"""Peak memory of learner ranks loading a model, this checkout against another side by side.

    python bench/load_memory.py --baseline /path/to/other/checkout [--ranks 1,2,4] [--size 1.7b]

Writes a random Qwen3 model (Qwen3-1.7B's shapes by default, bf16 safetensors) once, then for each rank count M
starts M learner ranks (processes of one gloo group, as `rlpipe train` does on CPU) with each checkout's code and
reports each rank's peak resident memory from its start until its model is loaded and sharded (the step and its
optimizer state, alike in both, are not built), the sum over ranks, and the load time. Each rank also reports its
resident memory before loading (interpreter, torch and rlpipe imported): the fixed overhead. Each row runs both
checkouts one after the other; the table gives after/before ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30
SIZES = {
    # Qwen3-1.7B's shapes: 1.72 B parameters, its embedding tied to the output projection.
    "1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True},
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096, "tie_word_embeddings": False},
}


def write_model(folder: Path, size: str) -> int:
    """A random Qwen3 model of `size` as a Hugging Face folder (bf16), written tensor by tensor; its parameter
    count."""
    import torch

    from rlpipe.models import save_state_dict
    from rlpipe.models.registry import build_model

    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
              **SIZES[size]}
    with torch.device("meta"):
        shapes = {name: param.shape for name, param in build_model(config).named_parameters()}
    generator = torch.Generator().manual_seed(0)

    def tensors():
        for name, shape in shapes.items():
            yield name, (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)

    save_state_dict(tensors(), config, folder, overwrite=True)
    return sum(shape.numel() for shape in shapes.values())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(checkout: Path, model: Path, ranks: int) -> list[dict]:
    """`ranks` learner ranks with `checkout`'s code, each reporting one JSON line."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "rank", str(model), str(rank), str(ranks), str(port)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=checkout,
        )
        for rank in range(ranks)
    ]
    reports = []
    for process in processes:
        out, err = process.communicate(timeout=1800)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if process.returncode != 0 or not lines:
            raise RuntimeError(f"a rank of {checkout} failed:\n{err[-3000:]}")
        reports.append(json.loads(lines[-1]))
    return reports


def rank_main(model: str, rank: int, ranks: int, port: int) -> None:
    """One rank: load the model as the learner does, stop before the step is built, report peak RSS."""
    import torch  # noqa: F401  (its import is part of the overhead, as in a learner)

    import rlpipe.training.train_engine as train_engine
    from rlpipe.config import load_config
    from rlpipe.training.learner import Learner

    def rss() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    class Loaded(Exception):
        pass

    def stop(*args, **kwargs):
        raise Loaded

    train_engine.GraphTrainStep = stop  # what follows the load and sharding: the step and its optimizer state
    overhead = rss()
    cfg = load_config(
        None,
        [f"model.path={model}", f"learner.ranks={ranks}", "model.dtype=bfloat16", "train.prompts_per_step=4",
         "rollout.group_size=2", "train.micro_batch_size=2"],
    )
    start = time.perf_counter()
    learner = Learner.from_config(model, cfg, rank=rank, world_size=ranks)
    try:
        learner.join_process_group("127.0.0.1", port)
    except Loaded:
        pass
    seconds = time.perf_counter() - start
    # The process's own high-water mark (VmHWM), not getrusage's ru_maxrss, which Linux carries over an exec from
    # the process this one was forked from (the bench's, which has just written the model).
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    print(json.dumps({"rank": rank, "overhead": overhead, "peak": peak, "seconds": seconds}), flush=True)
    os._exit(0)  # leave the gloo group without a collective teardown


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rank":
        model, rank, ranks, port = argv[1], *map(int, argv[2:5])
        rank_main(model, rank, ranks, port)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, type=Path, help="the checkout to compare against")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--size", default="1.7b", choices=sorted(SIZES))
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        params = write_model(model, args.size)
        model_bytes = params * 2
        print(f"model: {params / 1e9:.2f} B parameters, {model_bytes / GIB:.2f} GiB in bf16 (the learner's dtype here)")
        print(f"{'M':>2}  {'side':<8} {'overhead':>9} {'peak/rank':>10} {'sum':>8} {'model/M':>8} {'load s':>7}")
        for ranks in map(int, args.ranks.split(",")):
            rows = {}
            for side, checkout in (("before", args.baseline.resolve()), ("after", here)):
                reports = run_ranks(checkout, model, ranks)
                peak = max(report["peak"] for report in reports)
                rows[side] = (peak, sum(r["peak"] for r in reports), max(r["seconds"] for r in reports))
                overhead = max(report["overhead"] for report in reports)
                total, seconds = rows[side][1], rows[side][2]
                print(f"{ranks:>2}  {side:<8} {overhead / GIB:>8.2f}G {peak / GIB:>9.2f}G "
                      f"{total / GIB:>7.2f}G {model_bytes / ranks / GIB:>7.2f}G {seconds:>7.1f}", flush=True)
            (peak_b, sum_b, time_b), (peak_a, sum_a, time_a) = rows["before"], rows["after"]
            print(f"{ranks:>2}  after/before: peak per rank {peak_a / peak_b:.2f}x, sum {sum_a / sum_b:.2f}x, "
                  f"load time {time_a / time_b:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
