"""algo.advantage_estimator (rlpipe/algo/advantages.py): RLOO against TRL's RLOOTrainer's computation (its code,
with TRL's own `nanstd`), REINFORCE++ and REINFORCE++-baseline against verl's token-level formulas (verl is not
installed here: its `compute_reinforce_plus_plus_outcome_advantage`,
`compute_reinforce_plus_plus_baseline_outcome_advantage` and `masked_whiten`, verl/trainer/ppo/core_algos.py and
verl/utils/torch_functional.py, written out below on [B, T] tensors), what a step's batch gets, the keys'
one-line refusals; and DAPO's dynamic sampling (algo.dynamic_sampling) against scripted roles."""

from __future__ import annotations

import pytest
import torch

from rlpipe.algo import estimate_advantages, loss_defaults
from rlpipe.algo.advantages import leave_one_out_advantages
from rlpipe.config import ConfigError, load_config
from rlpipe.run.controller import make_train_batch
from rlpipe.types import Completion, Group, Prompt, StepScores

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


class _ScriptedRoles:
    """Roles whose engines give each prompt a group and whose reward functions score a group as `signal` says: a
    prompt index in it gets rewards 1, 0, 0, else 1, 1, 1 (no signal)."""

    def __init__(self, signal: set[int]):
        self.signal, self.seeds, self.generated = signal, [], []

    def seed(self, value: int) -> None:
        self.seeds.append(value)

    def start_generation(self, prompts, n):
        self.generated.append([p.sample_id for p in prompts])
        return [Group(p, [Completion([4, 5], [-0.5, -0.5], "x", "stop", 0) for _ in range(n)]) for p in prompts]

    def finish_generation(self, generation):
        return generation

    def score(self, groups, trainer_state=None):
        for group in groups:
            group.rewards = [1.0, 0.0, 0.0] if group.prompt.sample_id in self.signal else [1.0, 1.0, 1.0]
        return StepScores({"f": 1}, {"f": "first error"}, {"m": 1.0}, {})


class _Prompts:
    def __len__(self):
        return 100

    def prompts(self, indices):
        return [Prompt(int(i), "q", [1, 2, 3]) for i in indices]


class _Sampler:
    def __init__(self):
        self.drawn = 0

    def next(self, count):
        self.drawn += count
        return list(range(self.drawn - count, self.drawn))


def _dynamic(signal: set[int], rounds: int = 10):
    from types import SimpleNamespace

    from rlpipe.run.controller import with_enough_signal

    cfg = load_config(None, ["rollout.group_size=3", "train.prompts_per_step=4", "train.micro_batch_size=3",
                             "train.steps=5", "algo.dynamic_sampling=true", f"algo.max_generation_rounds={rounds}"])
    roles, sampler = _ScriptedRoles(signal), _Sampler()
    run = SimpleNamespace(train_set=_Prompts(), sampler=sampler)
    first = roles.start_generation(_Prompts().prompts(sampler.next(4)), 3)
    scores = roles.score(first)
    return roles, sampler, with_enough_signal(first, scores, 2, run, roles, cfg)


def test_dynamic_sampling_generates_again_until_enough_groups_have_signal():
    # Prompts 0-3: two with signal; 4-7: one more; 8-11: two more, of which the first completes the four.
    roles, sampler, (groups, scores, trained, metrics) = _dynamic({1, 3, 6, 8, 9})
    assert [g.prompt.sample_id for g in trained] == [1, 3, 6, 8]
    assert [g.prompt.sample_id for g in groups] == list(range(12))  # all it generated, for the step's metrics
    assert metrics == {"sampling/rounds": 3.0, "sampling/groups_generated": 12.0, "sampling/groups_with_signal": 5.0}
    assert roles.generated == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] and sampler.drawn == 12
    # Each extra round seeded apart from every step's own and from each other, whatever train.steps (which a run
    # resumed with more steps changes).
    assert roles.seeds == [2 + 1_000_000, 2 + 2_000_000]
    assert scores.failures == {"f": 3} and scores.errors == {"f": "first error"} and scores.logged == {"m": 1.0}


def test_dynamic_sampling_stops_at_its_cap_and_trains_on_what_has_signal():
    roles, sampler, (groups, _, trained, metrics) = _dynamic({2}, rounds=2)
    assert [g.prompt.sample_id for g in trained] == [2] and len(groups) == 8
    assert metrics["sampling/rounds"] == 2.0 and sampler.drawn == 8
    roles, sampler, (groups, _, trained, metrics) = _dynamic({0, 1, 2, 3})
    assert len(trained) == 4 and metrics["sampling/rounds"] == 1.0 and roles.seeds == []  # enough at once


def test_dynamic_sampling_is_refused_in_asynchronous_mode_in_one_line():
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["algo.dynamic_sampling=true", "train.max_staleness=1", "algo.tis_cap=2"])
    assert str(refused.value).startswith("algo.dynamic_sampling: a step that draws more prompts")
    assert "\n" not in str(refused.value)
