"""Run by test_xla_spmd.py in a fresh process (SPMD mode is process-wide and must be chosen before any XLA tensor
exists): trains the CPU eager learner and the xla learner sharded over an SPMD mesh on the same batches, in full
fine-tuning and then with LoRA adapters (`learner.lora`), and prints what the test compares as one JSON line for
each."""

from __future__ import annotations

import json
import sys

from rlpipe.hardware.device import xla_counters
from rlpipe.training.learner import Learner, combine_rank_metrics
from rlpipe.weightsync.form import weight_form
from tests.xla.test_xla_learner import LORA, STEPS, _batch, _config
from tests.weights import whole_weights


def xla_sharding(tensor) -> str:
    """The sharding XLA holds for `tensor`, e.g. `{devices=[2,1]0,1}` or `{replicated}`."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(tensor) or "{replicated}"


def main(model_path: str, devices: int) -> None:
    for extra in ((), LORA):
        compare(model_path, devices, extra)


def compare(model_path: str, devices: int, extra: tuple[str, ...]) -> None:
    batches = [_batch(seed) for seed in range(STEPS)]
    sharded_cfg = _config(model_path, "learner.device=xla", "learner.graph=true", f"learner.ranks={devices}", *extra)
    eager_cfg = _config(model_path, "learner.device=cpu", "learner.graph=false", *extra)
    sharded = Learner.from_config(model_path, sharded_cfg, form=weight_form(sharded_cfg, model_path))
    eager = Learner.from_config(model_path, eager_cfg, form=weight_form(eager_cfg, model_path))
    sharded.engine.ready()  # its one-off set-up (sharding the parameters and optimizer state) runs apart from the steps
    before = xla_counters()
    losses = {
        "sharded": [combine_rank_metrics([sharded.train_step(b)])["loss"] for b in batches],
        "eager": [combine_rank_metrics([eager.train_step(b)])["loss"] for b in batches],
    }
    spent = xla_counters() - before
    expected, got = whole_weights(eager), whole_weights(sharded)
    name, param = next(iter(sharded.model.named_parameters()))  # the embedding (frozen with LoRA)
    print(json.dumps({
        **losses,
        "lora": bool(extra),
        "trained": len(sharded.engine.ready().params),
        "moments": len(sharded.engine.ready().optimizer.exp_avg),
        "max_weight_difference": max(float((got[k] - v).abs().max()) for k, v in expected.items()),
        "parameter_sharding": xla_sharding(param),
        "moment_sharding": xla_sharding(sharded.engine.ready().optimizer.exp_avg[0]),
        "executions": spent.executions,
        "graph_breaks": sharded.engine.ready().graph_breaks,
    }))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
