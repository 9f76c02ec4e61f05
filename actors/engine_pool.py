"""The rollout engines as a pool: started in their placement, given prompts, started again when one dies.

The pool knows nothing of weights: an engine it starts again serves the model folder's weights, and whoever asked
for the replacement hands it to the weight sync (`SyncChannel.admit`) before using it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import ray

from rlpipe.actors.calls import CallTimeout, WorkerLost, reason
from rlpipe.actors.cluster import compute_env
from rlpipe.actors.placement import PlacedRole
from rlpipe.actors.rollout import RolloutActor
from rlpipe.hardware.gpu_layout import engine_memory_fraction
from rlpipe.config import Config
from rlpipe.reporting.logs import LogSetup
from rlpipe.types import Completion, Prompt
from rlpipe.weightsync.form import FULL, WeightForm
from rlpipe.weightsync import SyncError


@dataclass
class EngineShare:
    """The prompts (indexes into Generation.prompts) one engine is generating."""

    engine_index: int
    engine: object  # the handle the request went to: a replaced engine is not replaced twice
    prompts: range
    future: object


@dataclass
class Generation:
    """Prompts sent to the engines, whose completions are still to be collected."""

    prompts: list[Prompt]
    n: int
    sampling: dict
    shares: list[EngineShare]
    started: float = field(default_factory=time.monotonic)  # rollout.generate_timeout_s counts from here


class EnginePool:
    """`cfg.rollout.num_engines` engines in `placement`, one slot each. `note` reports an engine started again.

    An engine that does not answer a call within its deadline (`rollout.generate_timeout_s` for what may wait on a
    generation) is replaced like one that died. `form`: the run's weight form, which each engine is started for
    (adapters: it takes them through vLLM's LoRA support); engines that only evaluate serve full weights."""

    def __init__(
        self,
        cfg: Config,
        placement: PlacedRole,
        model_path: str,
        tokenizer_path: str | None,
        note: Callable[[str], None],
        log: LogSetup | None = None,
        form: WeightForm = FULL,
    ):
        self.cfg, self.placement, self.note, self.log = cfg, placement, note, log
        self.model_path, self.tokenizer_path, self.form = model_path, tokenizer_path, form
        self.engines: list = []
        self.restarts = [0] * cfg.rollout.num_engines

    def start(self) -> None:
        """Start every engine (returns at once: an engine is ready when it first answers)."""
        self.engines = [self._start(index) for index in range(self.cfg.rollout.num_engines)]

    def _start(self, index: int):
        log = None if self.log is None else replace(self.log, who=f"rollout-{index}")
        # On a share of a GPU, vLLM claims its memory fraction of that share.
        rollout = replace(self.cfg.rollout, gpu_memory_utilization=engine_memory_fraction(self.cfg))
        return RolloutActor.options(**self.placement.options(index, compute_env(self.cfg))).remote(
            self.model_path, rollout, self.cfg.run.seed + index, self.tokenizer_path, self.cfg.sync, log,
            self.cfg.model.kernels, self.form,
        )

    def hosts(self) -> list[str]:
        """The node address of each engine's slot, in engine order."""
        return self.placement.hosts()

    def replace(self, index: int, dead, error: Exception) -> bool:
        """Start a new engine in the place of `dead` (engine `index`) and wait until it serves; False when that was
        done already (several calls to one engine fail when it dies). The new engine holds the model folder's
        weights: the caller admits it to the weight sync. Raises WorkerLost past `rollout.max_restarts`, or when
        no live node has room for it."""
        if self.engines[index] is not dead:
            return False
        self.restarts[index] += 1
        limit = self.cfg.rollout.max_restarts
        if self.restarts[index] > limit:
            raise WorkerLost(f"rollout engine {index} died more than rollout.max_restarts={limit} times "
                             f"({reason(error)})")
        what = "stopped answering" if isinstance(error, CallTimeout) else "died"
        self.note(f"rollout engine {index} {what} ({reason(error)}); starting it again "
                  f"(restart {self.restarts[index]} of at most {limit})")
        self._wait_for_room(index, dead)
        ray.kill(dead, no_restart=True)
        self.engines[index] = self._start(index)
        started = self.engines[index].policy_version.remote()  # answered once the model is loaded
        timeout_s = self.cfg.ray.start_timeout_s
        try:
            ray.get(started, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise CallTimeout(f"restarted rollout engine {index}", "its start", timeout_s,
                              "ray.start_timeout_s") from None
        return True

    def _wait_for_room(self, index: int, dead) -> None:
        """Wait until engine `index`'s slot can take a new engine. An engine whose host stopped answering (powered
        off, cable cut) is only "unavailable" until the cluster's health checks declare the host dead (seconds);
        only then does Ray move the engine's placement-group bundle to a live host with room for it, so a new engine
        started before would be placed on the lost host and die with it. Waits at most ray.placement_timeout_s for
        that host to be declared dead and for room elsewhere; without room the run stops (WorkerLost)."""
        timeout_s = self.cfg.ray.placement_timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                ray.get(dead.policy_version.remote(), timeout=5)
            except ray.exceptions.ActorUnavailableError:  # not answering, not declared dead yet
                time.sleep(0.5)
                continue
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # dead (the usual case), or busy: either way it is replaced
            break  # (answering after all: a blip; it is replaced all the same)
        remaining = max(deadline - time.monotonic(), 0.0)
        if not self.placement.group.wait(timeout_seconds=remaining):
            resources = dict(self.cfg.placement.rollout.resources)
            raise WorkerLost(
                f"rollout engine {index} lost its host and no live node has room for it (placement.rollout.resources "
                f"{resources}) within {timeout_s:g} s (ray.placement_timeout_s)"
            )

    def seed(self, step: int) -> list[int]:
        """Seed every engine's sampling for this step (see RolloutEngine.seed); returns the engines that had died
        and were started again, which the caller admits to the weight sync and then seeds (`seed_engine`)."""
        calls = [(index, engine, engine.seed.remote(self._seed(step, index)))
                 for index, engine in enumerate(self.engines)]
        # A seed waits for the engine's generation in flight (asynchronous mode).
        deadline = time.monotonic() + self.cfg.rollout.generate_timeout_s
        replaced = []
        for index, engine, call in calls:
            try:
                self._get(call, index, "seed", deadline)
            except Exception as err:  # died (or hung, or can no longer serve) since the last step
                if not engine_gone(err):
                    raise
                if self.replace(index, engine, err):
                    replaced.append(index)
        return replaced

    def seed_engine(self, index: int, step: int) -> None:
        call = self.engines[index].seed.remote(self._seed(step, index))
        self._get(call, index, "seed", time.monotonic() + self.cfg.rollout.generate_timeout_s)

    def _get(self, call, index: int, name: str, deadline: float):
        """The result of engine `index`'s `call`, or CallTimeout past `deadline` (rollout.generate_timeout_s)."""
        try:
            return ray.get(call, timeout=max(deadline - time.monotonic(), 0.0))
        except ray.exceptions.GetTimeoutError:
            raise CallTimeout(f"rollout engine {index}", name, self.cfg.rollout.generate_timeout_s,
                              "rollout.generate_timeout_s") from None

    def _seed(self, step: int, index: int) -> int:
        return self.cfg.run.seed * 1_000_003 + step * 1009 + index

    def start_generation(self, prompts: list[Prompt], n: int, **sampling) -> Generation:
        """Send the prompts, split evenly across the engines, and return at once (asynchronous mode keeps the
        engines generating the next step while the learner trains)."""
        shares, start = [], 0
        for index, (engine, share) in enumerate(zip(self.engines, split(prompts, len(self.engines)))):
            if share:
                future = engine.generate.remote(share, n, **sampling)
                shares.append(EngineShare(index, engine, range(start, start + len(share)), future))
            start += len(share)
        return Generation(prompts, n, sampling, shares)

    def collect(self, generation: Generation) -> tuple[list[list[Completion]], list[int]]:
        """The completions of each prompt, and the engines started again because they died meanwhile. A prompt that
        an engine's death lost, or whose requests a weight sync aborted, comes back with none: send it again."""
        completions: list[list[Completion]] = [[] for _ in generation.prompts]
        replaced = []
        deadline = generation.started + self.cfg.rollout.generate_timeout_s
        for share in generation.shares:
            try:
                for index, group in zip(share.prompts, self._get(share.future, share.engine_index, "generate", deadline)):
                    completions[index] = group
            except Exception as err:
                if not engine_gone(err):
                    raise
                if self.replace(share.engine_index, share.engine, err):
                    replaced.append(share.engine_index)
        return completions, replaced


def engine_gone(err: Exception) -> bool:
    """Whether a failed call means its engine must be replaced: the actor died or passed its deadline, or it can no
    longer serve (a write broke off, or its rollback failed: its calls refuse with a SyncError)."""
    if isinstance(err, (ray.exceptions.RayActorError, CallTimeout)):
        return True
    return isinstance(err, ray.exceptions.RayTaskError) and isinstance(err.cause, SyncError)


def split(items: list, parts: int) -> list[list]:
    """Contiguous, near-equal shares, so results concatenate back in order."""
    base, extra = divmod(len(items), parts)
    shares, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        shares.append(items[start:stop])
        start = stop
    return shares
