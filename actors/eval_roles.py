"""The engines and reward workers of a run without its learner: `rlpipe eval` evaluates saved weights with them.

The engines serve the weights of the model folder they start from, so an engine that dies is started again from
it and needs no weight sync (actors/engine_pool.py); generation, seeding and scoring are those of a run's roles
(actors/roles.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace

import ray

from rlpipe.actors.calls import get_all
from rlpipe.actors.engine_pool import EnginePool
from rlpipe.actors.placement import PlacedRole, place_role
from rlpipe.actors.reward import RewardActor
from rlpipe.actors.reward_pool import RewardPool
from rlpipe.config import Config
from rlpipe.logs import LogSetup
from rlpipe.rewards.runner import reward_names
from rlpipe.tpu_layout import slice_shares
from rlpipe.types import Group, Prompt, StepScores


class EvalRoles:
    """`rollout.num_engines` engines on `model_path` and `reward.num_workers` reward workers, placed as a run's are."""

    def __init__(
        self,
        cfg: Config,
        model_path: str,
        tokenizer_path: str | None = None,
        reward_columns: list[str] | None = None,
        note: Callable[[str], None] = print,
        log: LogSetup | None = None,
    ):
        self.cfg, self.log = cfg, log
        self.placements: list[PlacedRole] = []
        self.rewarders: list = []
        self.pool: EnginePool | None = None
        try:
            self._start(model_path, tokenizer_path, reward_columns, note)
        except BaseException:  # release what did start: placement groups would otherwise hold the cluster
            self.shutdown()
            raise

    def _start(self, model_path: str, tokenizer_path: str | None, columns: list[str] | None, note) -> None:
        cfg = self.cfg
        timeout_s = cfg.ray.placement_timeout_s
        share = slice_shares(cfg.placement).get("rollout")
        engines = place_role("rollout", cfg.placement.rollout, cfg.rollout.num_engines, timeout_s,
                             chips_per_actor=cfg.rollout.tensor_parallel, share=share)
        self.placements.append(engines)
        rewarders = place_role("reward", cfg.placement.reward, cfg.reward.num_workers, timeout_s)
        self.placements.append(rewarders)
        self.pool = EnginePool(cfg, engines, model_path, tokenizer_path, note, self.log, synced=False)
        self.pool.start()
        specs = [asdict(spec) for spec in cfg.reward.functions]
        restarts = cfg.reward.max_restarts
        self.rewarders = [
            RewardActor.options(**rewarders.options(index), max_restarts=restarts, max_task_retries=restarts).remote(
                specs, cfg.reward, columns, None if self.log is None else replace(self.log, who=f"reward-{index}")
            )
            for index in range(cfg.reward.num_workers)
        ]
        self.rewards = RewardPool(self.rewarders, cfg.rollout.max_tokens, restarts, cfg.reward.deadline_s,
                                  reward_names(specs))
        get_all([e.policy_version.remote() for e in self.pool.engines] + [r.names.remote() for r in self.rewarders],
                cfg.ray.start_timeout_s, "the roles", "their start (model load)", "ray.start_timeout_s")

    def generate(self, prompts: list[Prompt], n: int, **sampling) -> list[Group]:
        """`n` completions per prompt; the prompts of an engine that died are generated again by its replacement."""
        generation = self.pool.start_generation(prompts, n, **sampling)
        completions, _ = self.pool.collect(generation)
        retry = [index for index, group in enumerate(completions) if not group]
        if retry:
            again = self.generate([prompts[i] for i in retry], n, **sampling)
            for index, group in zip(retry, again):
                completions[index] = group.completions
        return [Group(prompt, group) for prompt, group in zip(prompts, completions)]

    def seed(self, step: int) -> None:
        """Seed every engine's sampling as a run's roles do for `step` (Roles.seed)."""
        for index in self.pool.seed(step):
            self.pool.seed_engine(index, step)

    def score(self, groups: list[Group], trainer_state: dict | None = None) -> StepScores:
        return self.rewards.score(groups, trainer_state)

    def shutdown(self) -> None:
        engines = self.pool.engines if self.pool is not None else []
        for handle in [*engines, *self.rewarders]:
            ray.kill(handle)
        for placed in self.placements:
            placed.remove()
