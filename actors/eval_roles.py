"""The engines and reward workers of a run without its learner: `rlpipe eval` evaluates saved weights with them.

The engines serve the weights of the model folder they start from, so an engine that dies is started again from
it and needs no weight sync (actors/engine_pool.py); generation, seeding and scoring are those of a run's roles
(actors/roles.py)."""

from __future__ import annotations

from collections.abc import Callable

from rlpipe.actors.calls import get_all
from rlpipe.actors.engine_pool import EnginePool
from rlpipe.actors.roles import EngineRoles
from rlpipe.config import Config
from rlpipe.reporting.logs import LogSetup
from rlpipe.hardware.gpu_layout import gpu_layout
from rlpipe.hardware.tpu_layout import slice_shares


class EvalRoles(EngineRoles):
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
        super().__init__(cfg, note, log)
        try:
            self._start(model_path, tokenizer_path, reward_columns)
        except BaseException:  # release what did start: placement groups would otherwise hold the cluster
            self.shutdown()
            raise

    def _start(self, model_path: str, tokenizer_path: str | None, columns: list[str] | None) -> None:
        cfg = self.cfg
        engines = self._place("rollout", cfg.rollout.num_engines, chips_per_actor=cfg.rollout.tensor_parallel,
                              gpus_per_actor=gpu_layout(cfg).rollout, share=slice_shares(cfg.placement).get("rollout"))
        rewarders = self._place("reward", cfg.reward.num_workers)
        # Engines that only evaluate take no sync: they serve the folder's weights whole (the pool's default form).
        self.pool = EnginePool(cfg, engines, model_path, tokenizer_path, self.note, self.log)
        self.pool.start()
        self._start_rewards(rewarders, columns)
        get_all(sum(self.ready_calls().values(), []), cfg.ray.start_timeout_s, "the roles",
                "their start (model load)", "ray.start_timeout_s")
