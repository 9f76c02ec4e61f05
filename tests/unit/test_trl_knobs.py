"""The GRPO settings a TRL recipe ports, against TRL's own code on the same batch: the bias-corrected KL
(`algo.kl_bias_correction`), the advantages' std (`algo.advantage_std`), a pass after the policy moved (what
`train.num_iterations` trains on), `algo.mask_truncated_completions`, and the linear LR schedule. TRL's loss is
`GRPOTrainer._compute_loss` itself, run on a stand-in trainer whose model returns the given log-probs."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from rlpipe.algo import build_objective, group_advantages
from rlpipe.config import load_config
from rlpipe.run.controller import make_train_batch
from rlpipe.training.train_engine import lr_factor
from rlpipe.types import Completion, Group, LossInputs, ModelOutputs, Prompt

B, T = 6, 7


class _Identity:
    """One process's accelerate: gathering and reducing change nothing."""

    sync_gradients = True

    def gather(self, tensor):
        return tensor

    def reduce(self, tensor, reduction="sum"):
        return tensor

    gather_for_metrics = gather


def _trl_loss(logprobs, inputs: dict, *, loss_type, beta, bias_correction, eps_low, eps_high, level="token",
              entropies=None, entropy_coef=0.0):
    """TRL 1.16's GRPO loss of one micro-batch (no gradient accumulation, one process, no vLLM correction)."""
    GRPOTrainer = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer
    entropies = torch.zeros_like(logprobs) if entropies is None else entropies
    trainer = types.SimpleNamespace(
        loss_type=loss_type, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high, importance_sampling_level=level,
        args=types.SimpleNamespace(use_bias_correction_kl=bias_correction, delta=None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=entropy_coef != 0.0, entropy_coef=entropy_coef, use_adaptive_entropy=False,
        current_gradient_accumulation_steps=1, max_completion_length=T,
        model=types.SimpleNamespace(training=True), accelerator=_Identity(), _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logprobs, entropies, None),
    )
    trainer.get_high_entropy_mask = None
    return GRPOTrainer._compute_loss(trainer, None, inputs)


def _batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.bool)
    for row, length in enumerate([7, 5, 3, 6, 1, 4]):
        mask[row, length:] = False
    logprobs = -torch.rand(B, T, generator=generator, dtype=torch.float64) * 2
    old = logprobs + 0.3 * torch.randn(B, T, generator=generator, dtype=torch.float64)  # the policy has moved
    ref = logprobs + 0.5 * torch.randn(B, T, generator=generator, dtype=torch.float64)
    advantages = torch.randn(B, generator=generator, dtype=torch.float64)
    return mask, logprobs, old, ref, advantages


# (rlpipe overrides, TRL loss_type, TRL importance_sampling_level, clip range)
LOSSES = {
    "token-mean": (("algo.loss=grpo", "algo.loss_agg=token-mean"), "bnpo", "token", (0.2, 0.28)),
    "seq-mean-token-mean": (("algo.loss=grpo", "algo.loss_agg=seq-mean-token-mean"), "grpo", "token", (0.2, 0.28)),
    "gspo": (("algo.loss=gspo",), "grpo", "sequence", (3e-4, 4e-4)),
}


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("moved", [True, False], ids=["later-pass", "first-pass"])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_loss_and_gradient_equal_trls_with_the_kl_term(loss, moved, bias_correction):
    """A pass after the policy moved (old log-probs given, as every pass after the first of `train.num_iterations`)
    and the first pass (old = the forward's own), with TRL's bias-corrected KL and without it."""
    overrides, loss_type, level, (eps_low, eps_high) = LOSSES[loss]
    cfg = load_config(None, [*overrides, "algo.kl_beta=0.04", f"algo.kl_bias_correction={bias_correction}",
                             "algo.tis_cap=null"])
    objective = build_objective(cfg.algo, max_tokens=T)
    mask, logprobs, old, ref, advantages = _batch()

    ours = logprobs.clone().requires_grad_(True)
    inputs = LossInputs(mask=mask, advantages=advantages, rollout_logprobs=old, total_tokens=mask.sum().double(),
                        total_seqs=torch.tensor(float(B), dtype=torch.float64),
                        old_logprobs=old if moved else None, ref_logprobs=ref)
    loss_ours, _ = objective(ModelOutputs(ours, torch.zeros_like(ours), [], mask.reshape(-1)), inputs)
    loss_ours.backward()

    theirs = logprobs.clone().requires_grad_(True)
    trl_inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
                  "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
                  "advantages": advantages, "ref_per_token_logps": ref}
    if moved:
        trl_inputs["old_per_token_logps"] = old
    loss_trl = _trl_loss(theirs, trl_inputs, loss_type=loss_type, beta=0.04, bias_correction=bias_correction,
                         eps_low=eps_low, eps_high=eps_high, level=level)
    loss_trl.backward()

    assert float(loss_ours) == pytest.approx(float(loss_trl), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-10, atol=1e-14)
    assert theirs.grad.abs().sum() > 0


def test_the_bias_correction_changes_the_gradient_even_on_the_first_pass():
    """Where p = p_old the corrected KL has the same value, and still another gradient (the ratio's own)."""
    mask, logprobs, _, ref, advantages = _batch()
    grads = []
    for correction in (False, True):
        cfg = load_config(None, ["algo.kl_beta=0.04", f"algo.kl_bias_correction={correction}", "algo.tis_cap=null"])
        ours = logprobs.clone().requires_grad_(True)
        inputs = LossInputs(mask=mask, advantages=advantages * 0, rollout_logprobs=logprobs,
                            total_tokens=mask.sum().double(), total_seqs=torch.tensor(float(B)), ref_logprobs=ref)
        loss, _ = build_objective(cfg.algo, max_tokens=T)(ModelOutputs(ours, torch.zeros_like(ours), [], mask), inputs)
        loss.backward()
        grads.append((float(loss), ours.grad))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-12)
    assert not torch.allclose(grads[0][1], grads[1][1])


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_unbiased_advantages_equal_trls(scale):
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.3], dtype=torch.float64)
    ours = group_advantages(rewards, 4, scale, eps=1e-4, std="unbiased")
    # TRL 1.16's _generate_and_score_completions, one reward function. Its nanstd takes Bessel's factor n / (n - 1)
    # as a float32 (a quotient of integer tensors), so it agrees to float32 rounding; torch.std (verl's) to float64.
    mean = rewards.view(-1, 4).mean(dim=1).repeat_interleave(4)
    grouped = rewards.view(-1, 4) if scale == "group" else rewards.view(1, -1)
    repeat = 4 if scale == "group" else 12
    trl_std = nanstd(grouped, dim=1).repeat_interleave(repeat)
    torch.testing.assert_close(ours, (rewards - mean) / (trl_std + 1e-4), rtol=1e-7, atol=1e-12)
    torch_std = grouped.std(dim=1).repeat_interleave(repeat)
    torch.testing.assert_close(ours, (rewards - mean) / (torch_std + 1e-4), rtol=1e-12, atol=1e-15)
    population = group_advantages(rewards, 4, scale, eps=0.0, std="population")
    unbiased = group_advantages(rewards, 4, scale, eps=0.0, std="unbiased")
    n = 4 if scale == "group" else 12
    torch.testing.assert_close(unbiased, population * ((n - 1) / n) ** 0.5, rtol=1e-12, atol=1e-15)


def test_the_default_advantage_std_is_unbiased():
    assert load_config(None, []).algo.advantage_std == "unbiased"


def _groups(finish_reasons: list[list[str]], rewards: list[list[float]]) -> list[Group]:
    groups = []
    for index, (reasons, values) in enumerate(zip(finish_reasons, rewards, strict=True)):
        completions = [Completion([4 + i] * (2 + i), [-0.5] * (2 + i), "x", reason, 0) for i, reason in enumerate(reasons)]
        groups.append(Group(Prompt(index, "q", [1, 2, 3]), completions, rewards=list(values)))
    return groups


def test_truncated_completions_leave_the_loss_as_in_trl():
    reasons = [["stop", "length", "stop"], ["length", "stop", "stop"]]
    rewards = [[1.0, 0.0, 0.5], [1.0, 0.2, 0.0]]
    overrides = ["rollout.group_size=3", "train.prompts_per_step=2", "train.micro_batch_size=3", "algo.tis_cap=null",
                 "algo.loss_agg=seq-mean-token-mean"]
    kept, _ = make_train_batch(_groups(reasons, rewards), load_config(None, overrides), pad_id=0)
    cfg = load_config(None, [*overrides, "algo.mask_truncated_completions=true"])
    batch, stats = make_train_batch(_groups(reasons, rewards), cfg, pad_id=0)
    truncated = torch.tensor([False, True, False, True, False, False])
    assert stats["samples_trained"] == 6 and len(batch) == 6  # the rows stay: each counts as a sequence
    assert not batch.completion_mask[truncated].any() and batch.completion_mask[~truncated].any(-1).all()
    assert batch.advantages[truncated].tolist() == [0.0, 0.0]
    # The truncated samples' rewards still set their groups' mean and std.
    torch.testing.assert_close(batch.advantages[~truncated], kept.advantages[~truncated])

    # The loss on the batch against TRL's: TRL zeroes the truncated rows' completion_mask, as rlpipe's batch does.
    mask = batch.completion_mask
    generator = torch.Generator().manual_seed(1)
    logprobs = torch.where(mask, -torch.rand(mask.shape, generator=generator, dtype=torch.float64), 0.0)
    old = logprobs + 0.2 * torch.randn(mask.shape, generator=generator, dtype=torch.float64)
    trl_advantages = kept.advantages.double()  # TRL's advantages: every completion's, truncated ones included
    ours = logprobs.clone().requires_grad_(True)
    inputs = LossInputs(mask=mask, advantages=batch.advantages.double(), rollout_logprobs=old,
                        total_tokens=mask.sum().double(), total_seqs=torch.tensor(6.0, dtype=torch.float64),
                        old_logprobs=old)
    loss, _ = build_objective(cfg.algo, max_tokens=8)(ModelOutputs(ours, torch.zeros_like(ours), [], mask), inputs)
    loss.backward()
    theirs = logprobs.clone().requires_grad_(True)
    width = mask.shape[1]
    full = kept.completion_mask
    trl_inputs = {"prompt_ids": torch.zeros(6, 1, dtype=torch.long), "prompt_mask": torch.ones(6, 1, dtype=torch.long),
                  "completion_ids": torch.zeros(6, width, dtype=torch.long),
                  "completion_mask": full.long() * (~truncated).unsqueeze(1).long(),  # TRL's mask_truncated_completions
                  "advantages": trl_advantages, "old_per_token_logps": old}
    loss_trl = _trl_loss(theirs, trl_inputs, loss_type="grpo", beta=0.0, bias_correction=True, eps_low=0.2,
                         eps_high=0.28)
    loss_trl.backward()
    assert float(loss) == pytest.approx(float(loss_trl), rel=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-10, atol=1e-14)
    assert not theirs.grad[truncated].any() and theirs.grad.abs().sum() > 0


@pytest.mark.parametrize("schedule, name, kwargs", [
    ("linear", "linear", {}),
    ("cosine", "cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("constant", "constant", {}),
])
def test_each_schedule_is_transformers_after_rlpipes_warm_up(schedule, name, kwargs):
    from transformers import get_scheduler

    parameter = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=3, num_training_steps=12,
                              scheduler_specific_kwargs=kwargs)
    theirs = []
    for _ in range(14):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    ours = [lr_factor(step, 3, 12, schedule, 0.1) for step in range(14)]
    assert ours[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])  # rlpipe's first warm-up step trains; TRL's runs at lr 0
    if schedule != "constant":  # transformers' constant schedule has no warm-up
        assert theirs[:3] == pytest.approx([0.0, 1 / 3, 2 / 3])
    assert ours[3:12] == pytest.approx(theirs[3:12], abs=1e-15)
    held = {"linear": 0.0, "cosine": 0.1, "constant": 1.0}[schedule]  # at the last step and beyond it
    assert ours[12:] == pytest.approx([held, held], abs=1e-15) and theirs[12] == pytest.approx(held, abs=1e-15)
    assert load_config(None, [f"train.lr_schedule={schedule}"]).train.lr_schedule == schedule


def test_the_learner_imports_no_transformers_schedule():
    """The schedule's arithmetic is rlpipe's: transformers' trainer stack stays out of the learner's first step."""
    import subprocess
    import sys

    code = ("import sys; from rlpipe.training.train_engine import lr_factor; lr_factor(5, 2, 10, 'cosine', 0.1); "
            "print('transformers.optimization' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_entropy_bonus_equals_trls(loss):
    """`algo.entropy_coef` against TRL's `entropy_coef` on the same batch and entropies: the loss and the gradients
    to both the log-probs and the entropies. Padding carries large entropies that must not count."""
    overrides, loss_type, level, (eps_low, eps_high) = LOSSES[loss]
    cfg = load_config(None, [*overrides, "algo.entropy_coef=0.01", "algo.tis_cap=null"])
    objective = build_objective(cfg.algo, max_tokens=T)
    assert objective.every_row_counts  # a zero-advantage row still has an entropy gradient
    mask, logprobs, old, _, advantages = _batch(2)
    entropy = torch.where(mask, torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(3)), 50.0)

    ours, ours_entropy = logprobs.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    inputs = LossInputs(mask=mask, advantages=advantages, rollout_logprobs=old, total_tokens=mask.sum().double(),
                        total_seqs=torch.tensor(float(B), dtype=torch.float64), old_logprobs=old)
    loss_ours, stats = objective(ModelOutputs(ours, ours_entropy, [], mask.reshape(-1)), inputs)
    loss_ours.backward()

    theirs, their_entropy = logprobs.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    trl_inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
                  "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
                  "advantages": advantages, "old_per_token_logps": old}
    loss_trl = _trl_loss(theirs, trl_inputs, loss_type=loss_type, beta=0.0, bias_correction=False, eps_low=eps_low,
                         eps_high=eps_high, level=level, entropies=their_entropy, entropy_coef=0.01)
    loss_trl.backward()

    assert float(loss_ours) == pytest.approx(float(loss_trl), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(ours_entropy.grad, their_entropy.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ours_entropy.grad[mask], torch.full((int(mask.sum()),), -0.01 / int(mask.sum()),
                                                                   dtype=torch.float64), rtol=1e-12, atol=0)
    assert not ours_entropy.grad[~mask].any()
    assert float(stats.entropy) == pytest.approx(float(entropy[mask].sum()))  # the metric: trained tokens only
    assert load_config(None, []).algo.entropy_coef == 0.0
    assert not build_objective(load_config(None, ["algo.tis_cap=null"]).algo, max_tokens=T).terms


@pytest.mark.parametrize("impl", ["chunked", "reference"])
def test_the_learners_entropy_has_its_gradient(impl):
    """The entropy the bonus trains on comes out of the log-prob kernel with the gradient of -sum p log p."""
    from rlpipe.kernels.logprob import linear_logprob

    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, 8, generator=generator, dtype=torch.float64)
    weight = torch.randn(11, 8, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 11, (5,), generator=generator)
    upstream = torch.randn(2, 5, generator=generator, dtype=torch.float64)
    grads = []
    for compute in ("kernel", "autograd"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if compute == "kernel":
            logprob, entropy = linear_logprob(h, w, targets, temperature=0.7, impl=impl, chunk=4)
        else:
            log_softmax = torch.log_softmax(h @ w.T / 0.7, dim=-1)
            logprob = log_softmax.gather(1, targets[:, None]).squeeze(1)
            entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        ((logprob * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
        grads.append((h.grad, w.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-4, atol=1e-5)


def test_the_entropy_bonus_refuses_the_kernel_without_an_entropy_gradient():
    from rlpipe.config.errors import ConfigError

    with pytest.raises(ConfigError, match="algo.entropy_coef: the pallas log-prob kernel"):
        load_config(None, ["algo.entropy_coef=0.01", "model.kernels.logprob=pallas"])
    with pytest.raises(ConfigError, match="algo.entropy_coef: must be a finite number"):
        load_config(None, ["algo.entropy_coef=nan"])
