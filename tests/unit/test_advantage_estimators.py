"""algo.advantage_estimator (rlpipe/algo/advantages.py): RLOO against TRL's RLOOTrainer's computation (its code,
with TRL's own `nanstd`), REINFORCE++ and REINFORCE++-baseline against verl's token-level formulas (verl is not
installed here: its `compute_reinforce_plus_plus_outcome_advantage`,
`compute_reinforce_plus_plus_baseline_outcome_advantage` and `masked_whiten`, verl/trainer/ppo/core_algos.py and
verl/utils/torch_functional.py, written out below on [B, T] tensors), what a step's batch gets, and the keys'
one-line refusals."""

from __future__ import annotations

import pytest
import torch

from rlpipe.algo import estimate_advantages, loss_defaults
from rlpipe.algo.advantages import leave_one_out_advantages
from rlpipe.config import ConfigError, load_config
from rlpipe.run.controller import make_train_batch
from rlpipe.types import Completion, Group, Prompt

GROUP = 4


def _rewards(seed: int, groups: int = 6, unscored: bool = True) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (groups * GROUP,), generator=generator).float() + torch.rand(groups * GROUP,
                                                                                                generator=generator)
    rewards[GROUP : 2 * GROUP] = 1.0  # a group without signal
    if unscored:
        rewards[[1, 9, 10, 11]] = float("nan")  # one unscored sample; a group with one scored sample left
    return rewards


def _trl_rloo(rewards: torch.Tensor, num_generations: int, normalize_advantages: bool) -> torch.Tensor:
    """TRL 1.16's RLOOTrainer._generate_and_score_completions, from its grouped rewards to its advantages."""
    from trl.trainer.utils import nanstd

    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
    advantages = rewards - baselines.view(-1)
    if normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scale", ["none", "batch"])
def test_rloo_gives_trls_rloo_advantages(seed, scale):
    rewards = _rewards(seed)
    ours = estimate_advantages(rewards, GROUP, "rloo", scale)
    torch.testing.assert_close(ours, _trl_rloo(rewards, GROUP, scale == "batch"), atol=1e-5, rtol=0)
    assert ours[[1, 9, 10, 11]].eq(0).all()  # unscored, and the one scored sample of a group, get no signal
    if scale == "none":
        assert ours[GROUP : 2 * GROUP].eq(0).all()
        # Leave-one-out is n/(n-1) times GRPO's group-centred reward (full groups).
        grpo = estimate_advantages(rewards, GROUP, "grpo", "none")
        torch.testing.assert_close(ours[16:], grpo[16:] * GROUP / (GROUP - 1), atol=1e-5, rtol=0)


def _verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = (values * mask).sum() / mask.sum()
    variance = ((values - mean) ** 2 * mask).sum() / mask.sum()
    variance = variance * mask.sum() / (mask.sum() - 1)  # unbiased
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def _verl_token_rewards(rewards: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An outcome reward as verl holds it: on each response's last token of a [B, T] tensor, and the response mask."""
    mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).float()
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(rewards)), lengths - 1] = rewards
    return token_rewards, mask


def _verl_reinforce_pp(rewards, lengths, gamma: float = 1.0) -> torch.Tensor:
    token_rewards, mask = _verl_token_rewards(rewards, lengths)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(len(rewards))
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return _verl_masked_whiten(returns, mask) * mask, mask


def _verl_reinforce_pp_baseline(rewards, lengths, group_size: int) -> torch.Tensor:
    token_rewards, mask = _verl_token_rewards(rewards, lengths)
    scores = token_rewards.sum(dim=-1)
    means = scores.view(-1, group_size).mean(dim=1).repeat_interleave(group_size)
    scores = (scores - means).unsqueeze(-1) * mask
    return _verl_masked_whiten(scores, mask) * mask, mask


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_gives_verls_token_level_advantages(seed, estimator):
    rewards = _rewards(seed, unscored=False)
    lengths = torch.randint(1, 9, (len(rewards),), generator=torch.Generator().manual_seed(seed + 10))
    if estimator == "reinforce_pp":
        expected, mask = _verl_reinforce_pp(rewards, lengths)
    else:
        expected, mask = _verl_reinforce_pp_baseline(rewards, lengths, GROUP)
    ours = estimate_advantages(rewards, GROUP, estimator, "none", tokens=lengths)
    # verl's advantage is one value over each response's tokens: ours, per sample.
    torch.testing.assert_close(ours[:, None] * mask, expected, atol=1e-5, rtol=0)
    tokens = lengths.float()
    assert (ours * tokens).sum() / tokens.sum() == pytest.approx(0.0, abs=1e-5)  # zero mean over the batch's tokens
    if estimator == "reinforce_pp":  # the batch is the baseline: a group without spread still has signal
        assert ours[GROUP : 2 * GROUP].ne(0).all()


def test_reinforce_pp_leaves_unscored_samples_out_of_the_whitening():
    rewards = _rewards(0)
    tokens = torch.full((len(rewards),), 3.0)
    ours = estimate_advantages(rewards, GROUP, "reinforce_pp", "none", tokens=tokens)
    scored = ~rewards.isnan()
    assert ours[~scored].eq(0).all()
    again = estimate_advantages(rewards[scored], 1, "reinforce_pp", "none", tokens=tokens[scored])
    torch.testing.assert_close(ours[scored], again, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="reinforce_pp whitens over tokens"):
        estimate_advantages(rewards, GROUP, "reinforce_pp", "none")


def _groups(rewards: list[list[float | None]], lengths: list[list[int]]) -> list[Group]:
    return [Group(Prompt(index, "q", [1, 2, 3]),
                  [Completion([4] * n, [-0.5] * n, "x", "stop", 0) for n in sizes], rewards=list(values))
            for index, (values, sizes) in enumerate(zip(rewards, lengths))]


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_a_steps_batch_carries_the_estimators_advantages(estimator):
    cfg = load_config(None, ["rollout.group_size=3", "train.micro_batch_size=3", "train.prompts_per_step=2",
                             f"algo.advantage_estimator={estimator}"])
    rewards, lengths = [[1.0, 0.0, 0.5], [2.0, None, 0.0]], [[2, 3, 4], [1, 5, 2]]
    batch, stats = make_train_batch(_groups(rewards, lengths), cfg, pad_id=0)
    flat = torch.tensor([float("nan") if r is None else r for row in rewards for r in row])
    tokens = torch.tensor([n for row in lengths for n in row], dtype=torch.float32)
    scale, _ = loss_defaults(cfg.algo)
    assert scale == "none"
    expected = estimate_advantages(flat, 3, estimator, scale, tokens=tokens)
    assert len(batch) == 5  # the unscored sample is left out
    torch.testing.assert_close(batch.advantages, expected[~flat.isnan()], atol=1e-6, rtol=0)
    if estimator == "rloo":
        assert batch.advantages[0].item() == pytest.approx(1.0 - 0.25)  # 1 minus the mean of 0 and 0.5


@pytest.mark.parametrize("overrides, refusal", [
    (["algo.advantage_estimator=rloo", "algo.advantage_scale=group"], "algo.advantage_scale: rloo's advantages"),
    (["algo.advantage_estimator=reinforce_pp", "algo.advantage_scale=batch"],
     "algo.advantage_scale: reinforce_pp whitens its advantages"),
    (["algo.advantage_estimator=ppo"], "algo.advantage_estimator"),
])
def test_estimator_settings_that_do_not_go_together_are_refused_in_one_line(overrides, refusal):
    with pytest.raises(ConfigError) as refused:
        load_config(None, overrides)
    assert refusal in str(refused.value) and "\n" not in str(refused.value)


def test_leave_one_out_needs_two_scored_samples_a_group():
    assert leave_one_out_advantages(torch.tensor([1.0, float("nan"), 3.0, 5.0]), 2).tolist() == [0.0, 0.0, -2.0, 2.0]
