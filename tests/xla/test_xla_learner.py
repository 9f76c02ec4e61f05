"""The learner on PyTorch/XLA (PJRT's CPU client): the whole train step as one XLA program per length bucket, with
the CPU eager learner's losses."""

from __future__ import annotations

import pytest
import torch

from rlpipe.config import load_config
from rlpipe.hardware.device import backend, torch_device, xla_counters
from rlpipe.training.learner import Learner, combine_rank_metrics
from rlpipe.types import TrainBatch
from rlpipe.weightsync.form import weight_form
from tests.weights import whole_weights

STEPS = 3


def _config(model_path, *overrides):
    return load_config(
        None,
        [
            f"model.path={model_path}",
            "rollout.group_size=2",
            "train.prompts_per_step=2",
            "train.micro_batch_size=2",
            "train.lr=1e-3",
            # Adam's first steps move an element by about lr * g / (|g| + eps): with a near-zero gradient and the
            # default eps, float noise between XLA's and eager's summation order becomes a visible weight
            # difference. That is Adam's conditioning, not the capture under test (as in test_graph_trainer.py).
            "train.adam_eps=1e-4",
            f"train.steps={STEPS}",
            "learner.length_buckets=[16,32]",
            "data.max_prompt_tokens=16",
            "rollout.max_tokens=16",
            "rollout.max_model_len=32",
            *overrides,
        ],
    )


def _batch(seed: int, longest: int = 12) -> TrainBatch:
    """Four sequences of 5 to `longest` tokens, the completion half of each scored."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [longest, 5, 9, 7]
    prompts = [torch.randint(3, 300, (n // 2,), generator=generator).tolist() for n in lengths]
    completions = [torch.randint(3, 300, (n - n // 2,), generator=generator).tolist() for n in lengths]
    logprobs = [[-1.5] * len(c) for c in completions]
    return TrainBatch.from_sequences(prompts, completions, logprobs, [1.0, -1.0, 0.5, -0.5], pad_id=0)


def _losses(learner: Learner, batches: list[TrainBatch]) -> list[float]:
    return [combine_rank_metrics([learner.train_step(batch)])["loss"] for batch in batches]


def test_xla_backend_row_and_device():
    spec = backend("xla")
    assert (spec.dist_backend, spec.compile_backend) == ("xla", "openxla")
    assert torch_device("xla").type == "xla"


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        # Two optimizer steps a batch (so a separate old-logprob pass) and a KL term (so a reference model's pass):
        # the forward-only passes on xla too.
        ["train.mini_batch_size=2", "algo.kl_beta=0.1"],
    ],
    ids=["one-optimizer-step", "mini-batches-and-kl"],
)
def test_graph_step_on_xla_equals_the_cpu_eager_learner(tiny_qwen3, overrides):
    batches = [_batch(seed) for seed in range(STEPS)]
    eager = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "learner.device=cpu", "learner.graph=false", *overrides))
    xla = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "learner.device=xla", "learner.graph=true", *overrides))
    assert next(xla.model.parameters()).device.type == "xla"
    expected, got = _losses(eager, batches), _losses(xla, batches)
    assert got == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == STEPS  # the steps differ, so equal lists are not one repeated number
    # The weights after three updates, too: the optimizer ran inside the program, not only the loss.
    for name, value in whole_weights(eager).items():
        torch.testing.assert_close(whole_weights(xla)[name], value, atol=1e-5, rtol=1e-4)


def test_one_program_per_bucket_and_no_host_sync_inside_the_step(tiny_qwen3):
    # Buckets no other test uses: XLA keeps compiled programs for the whole process, keyed by the graph, so a shape
    # seen in an earlier test would be found in the cache and compile nothing here.
    overrides = ["learner.length_buckets=[24,40]", "rollout.max_model_len=40", "rollout.max_tokens=24"]
    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "learner.device=xla", "learner.graph=true", *overrides))
    step = learner.engine.ready()
    before = xla_counters()
    for seed in range(STEPS):
        learner.train_step(_batch(seed))  # all in the 24 bucket
    spent = xla_counters() - before
    assert step.compiles == 1
    assert spent.executions == STEPS  # one program a step: nothing cut the trace
    assert step.graph_breaks == 0 and step.xla_fallbacks == {}
    learner.train_step(_batch(7, longest=30))  # the 40 bucket: one more program
    learner.train_step(_batch(8, longest=20))  # back in the 24 bucket: taken from the cache
    assert step.compiles == 2 and step.graph_breaks == 0


def test_a_host_sync_inside_the_step_is_counted(tiny_qwen3):
    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "learner.device=xla", "learner.graph=true"))
    step = learner.engine.ready()
    original = step.loss_fn

    def loss_with_a_sync(model, micro):
        loss, stats = original(model, micro)
        if loss.item() > -1e9:  # a data-dependent Python branch: the trace must run to answer it
            loss = loss * 1.0
        return loss, stats

    step.loss_fn = loss_with_a_sync
    learner.train_step(_batch(0))
    assert step.graph_breaks >= 1


def test_pallas_kernel_choices_stay_inside_the_xla_program(tiny_qwen3):
    """On XLA's CPU client torch_xla's Pallas bridge cannot run (it builds TPU custom calls), so `pallas` means the
    torch implementations there: the same losses as the default kernels, and still one program a step."""
    from rlpipe.kernels._xla import xla_kernel_routes

    pallas = ["model.kernels.attention=pallas", "model.kernels.rmsnorm=pallas", "model.kernels.logprob=pallas"]
    routes = xla_kernel_routes("pallas", "pallas", "pallas")
    assert all("torch" in route or "chunked" in route for route in routes.values()), routes
    batches = [_batch(seed) for seed in range(2)]
    default = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "learner.device=xla", "learner.graph=true"))
    chosen = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "learner.device=xla", "learner.graph=true", *pallas))
    assert _losses(chosen, batches) == pytest.approx(_losses(default, batches), abs=1e-6)
    assert chosen.engine.ready().graph_breaks == 0 and chosen.engine.ready().xla_fallbacks == {}



def test_checkpoint_round_trip_on_xla(tiny_qwen3, tmp_path):
    xla = ["learner.device=xla", "learner.graph=true"]
    saved = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, *xla))
    _losses(saved, [_batch(0)])
    saved.save_checkpoint(str(tmp_path))
    resumed = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, *xla))
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.engine.optimizer_steps_taken == 1 and resumed.policy_version == 1
    # Same weights and AdamW moments: the next step is the same step.
    assert _losses(resumed, [_batch(1)]) == _losses(saved, [_batch(1)])
    assert resumed.engine.ready().graph_breaks == 0


LORA = ("learner.lora.rank=2", "learner.lora.alpha=4")


@pytest.mark.parametrize("kl", [[], ["algo.kl_beta=0.1"]], ids=["no-kl", "kl-to-the-base"])
def test_lora_on_xla_trains_the_adapters_as_the_cpu_eager_learner_does(tiny_qwen3, kl):
    """learner.lora on the xla learner: the base frozen on the device and unchanged, AdamW's state for the adapters
    alone, and after three steps (the first moves B off zero, the later ones A as well) the CPU eager learner's
    losses and adapters, one program a step; with a KL term, its reference is the base read with the adapters off
    on the device too, no copy. (Both learners start from the same adapters: the learner seeds torch before it adds
    them.)"""
    from rlpipe.training.lora import is_adapter_key
    from rlpipe.models import load_model

    batches = [_batch(seed) for seed in range(STEPS)]
    eager_cfg = _config(tiny_qwen3, "learner.device=cpu", "learner.graph=false", *LORA, *kl)
    xla_cfg = _config(tiny_qwen3, "learner.device=xla", "learner.graph=true", *LORA, *kl)
    eager = Learner.from_config(tiny_qwen3, eager_cfg, form=weight_form(eager_cfg, tiny_qwen3))
    xla = Learner.from_config(tiny_qwen3, xla_cfg, form=weight_form(xla_cfg, tiny_qwen3))
    assert xla.reference is None and xla.engine.frozen == []
    adapters = {name: param for name, param in xla.model.named_parameters() if is_adapter_key(name)}
    start = {name: param.detach().cpu() for name, param in adapters.items()}
    step = xla.engine.ready()
    assert {id(p) for p in step.params} == {id(p) for p in adapters.values()}
    assert len(step.optimizer.exp_avg) == len(step.optimizer.exp_avg_sq) == len(adapters)
    assert all(moment.device.type == "xla" for moment in step.optimizer.exp_avg)

    expected, got = _losses(eager, batches), _losses(xla, batches)
    assert got == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == STEPS
    assert step.compiles == 1 and step.graph_breaks == 0 and step.xla_fallbacks == {}
    eager_params = dict(eager.model.named_parameters())
    base = load_model(tiny_qwen3).state_dict()
    for name, param in xla.model.named_parameters():
        value = param.detach().cpu()
        if is_adapter_key(name):
            assert not torch.equal(value, start[name]), name  # trained
            torch.testing.assert_close(value, eager_params[name].detach(), atol=1e-5, rtol=1e-4)
        else:
            assert param.device.type == "xla" and not param.requires_grad, name
            assert torch.equal(value, base[name]), name  # the base never moves
