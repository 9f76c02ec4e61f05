"""Ray actor owning one vLLM engine (rlpipe/rollout/engine.py does the work).

Generation and weight sync run in separate concurrency groups (one thread each), so buckets of the next version
arrive while the engine generates, and a sync requested mid-generation is handled per `sync.on_generation`. A third
group answers the driver's liveness check while both are busy.

An engine ends by `close` (the run's shutdown asks before it kills the actor): vLLM's processes stop and every file
it and the engine made in /dev/shm goes. The engine notes the names of vLLM's files in a record of its own there
(`rlpipe-engine-<pid>`), so that those of an engine killed before its close (a killed driver takes its engines with
it) are removed by the next engine started on the host (rlpipe/rollout/vllm_files.py).

An engine that can no longer serve — its vLLM process or a worker process died, or a write was cut short by a
BaseException — ends this actor's process: the driver then finds the actor dead and replaces it as any lost engine
(actors/engine_pool.py), instead of waiting on a call vLLM will never answer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from dataclasses import replace

import ray

from rlpipe.config import KernelsConfig, RolloutConfig, SyncConfig
from rlpipe.reporting.logs import FILE_ONLY, LogSetup, configure_worker
from rlpipe.hardware.tpu_env import keep_only_given_tpu_env
from rlpipe.models.hf import read_hf_config
from rlpipe.rollout.engine import RolloutEngine, workers_in_process
from rlpipe.rollout.vllm_worker import vllm_platform
from rlpipe.rollout.vllm_files import (
    ENGINE_RECORD_PREFIX, record_engine_files, remove_engine_files, shm_names, sweep_engine_files,
)
from rlpipe.types import Completion, Prompt
from rlpipe.weightsync.form import FULL, WeightForm
from rlpipe.weightsync import SyncPlan
from rlpipe.weightsync.ownership import SHM_DIR
from rlpipe.weightsync.receiver import CommitResult

logger = logging.getLogger("rlpipe.rollout.engine")

# How often the watchdog looks at the engine's processes.
_WATCH_INTERVAL_S = 0.5


def engine_failure(llm) -> str | None:
    """Why the vLLM engine `llm` can no longer answer, or None while it can. vLLM 0.32 marks an engine-core process
    that died (`MPClient.resources.engine_dead`, set by its monitor thread) and a multiprocess executor whose worker
    died (`MultiprocExecutor.is_failed`), but a call already waiting on either is never answered."""
    client = llm.llm_engine.engine_core
    resources = getattr(client, "resources", None)
    if resources is not None and resources.engine_dead:
        return "its vLLM engine process died"
    executor = getattr(getattr(client, "engine_core", None), "model_executor", None)
    if getattr(executor, "is_failed", False):
        return "a vLLM worker process died"
    return None


def platform_refusal(platform: str, gpu_ids: list) -> str | None:
    """Why an engine whose vLLM runs on `platform` cannot serve with the GPUs Ray gave it (`gpu_ids`), or None: vLLM
    for CPU would hold a GPU reservation and compute on the host, vLLM for CUDA finds no device without one."""
    if gpu_ids and platform != "cuda":
        return (f"rollout: Ray gave this engine GPU(s) {', '.join(map(str, gpu_ids))} (placement.rollout.gpus) but "
                f"its environment's vLLM runs on {platform}; install the cuda extra there, or set "
                f"placement.rollout.gpus: 0")
    if platform == "cuda" and not gpu_ids:
        return ("rollout: this engine's vLLM is for CUDA but Ray gave it no GPU; set placement.rollout.gpus (or "
                "learner.device: cuda, whose default gives the engines GPUs)")
    return None


def end_process(why: str) -> None:
    """End this actor's process at once (no cleanup that could wait on the dead engine): the driver replaces it."""
    # The driver's line says it on the terminal (actors/engine_pool.py); this one is for the log file.
    logger.error("rollout engine: %s; this engine's actor exits so that it is replaced", why, extra=FILE_ONLY)
    logging.shutdown()
    os._exit(1)


@ray.remote(concurrency_groups={"sync": 1, "watch": 1})
class RolloutActor:
    def __init__(
        self,
        model_path: str,
        cfg: RolloutConfig,
        seed: int,
        tokenizer_path: str | None = None,
        sync: SyncConfig | None = None,
        log: LogSetup | None = None,
        kernels: KernelsConfig | None = None,
        form: WeightForm = FULL,
    ):
        keep_only_given_tpu_env()  # also where Ray was started without rlpipe's job environment (actors/cluster.py)
        if log is not None:  # before vLLM is imported: its import logs too
            tied = bool(read_hf_config(model_path).get("tie_word_embeddings", False))
            configure_worker(replace(log, tied_output_layer=tied), vllm=True)
        progress_bars = log is None or log.verbose  # vLLM's bar for loading the weights
        refused = platform_refusal(vllm_platform(), ray.get_gpu_ids())
        if refused:
            raise RuntimeError(refused)
        sweep_engine_files()  # what engines killed before their close left on this host
        before = shm_names()
        self._closing = False
        self.engine = RolloutEngine(
            model_path, cfg, seed, tokenizer_path, sync, kernels=kernels, progress_bars=progress_bars, form=form
        )
        record_engine_files(before)
        if not workers_in_process(cfg):  # vLLM's processes may die under a live actor
            threading.Thread(target=self._watch, daemon=True, name="rlpipe-engine-watch").start()

    def _watch(self) -> None:
        while not self._closing:  # once closing, vLLM's processes end on purpose
            if (why := engine_failure(self.engine.llm)) is not None:
                end_process(why)
            time.sleep(_WATCH_INTERVAL_S)

    @ray.method(concurrency_group="watch")
    def close(self) -> None:
        """Stop the engine (vLLM's processes end) and remove every file it and vLLM made in /dev/shm, the record of
        them included; answered even while a generation or a sync is busy (they fail: the run is ending)."""
        self._closing = True
        try:
            self.engine.close()
        finally:
            with contextlib.suppress(FileNotFoundError):
                remove_engine_files(os.path.join(SHM_DIR, f"{ENGINE_RECORD_PREFIX}{os.getpid()}"))

    @ray.method(concurrency_group="watch")
    def alive(self) -> bool:
        """Whether the engine can still serve; answered even while generation and a sync are both busy."""
        return engine_failure(self.engine.llm) is None and not self.engine.sync.unusable

    def generate(self, prompts: list[Prompt], n: int, **sampling) -> list[list[Completion]]:
        return self.engine.generate(prompts, n, **sampling)

    def probe_by_decoding(self) -> bool:
        return self.engine.probe_by_decoding

    def policy_version(self) -> int:
        return self.engine.policy_version

    def seed(self, seed: int) -> None:
        self.engine.seed(seed)

    @ray.method(concurrency_group="watch")
    def held_version(self) -> int:
        """The policy version, answered even while a generation or a sync's call runs."""
        return self.engine.policy_version

    @ray.method(concurrency_group="sync")
    def layout(self):
        return self.engine.layout()

    # The engine's end of the weight-sync channel (rlpipe/weightsync/receiver.py), called by the channel's driver
    # side (actors/sync_channel.py) and, for each part, by the learner ranks.

    @ray.method(concurrency_group="sync")
    def join_sync_process_group(self, address: str, port: int, rank: int, learner_ranks: int, world: int) -> None:
        self.engine.sync.transport.connect(address, port, rank, learner_ranks, world, self.engine.sync_cfg.timeout_s)

    @ray.method(concurrency_group="sync")
    def set_sync_routes(self, routes: list[str], whole_buckets: bool) -> None:
        """The route from each learner rank (rlpipe/weightsync/routes.py)."""
        self.engine.sync.transport.set_routes(routes, whole_buckets)

    @ray.method(concurrency_group="sync")
    def begin_sync(self, plan: SyncPlan, version: int, key: bytes) -> None:
        """`key`: the run's secret that the parts' checksums are keyed with."""
        self.engine.sync.begin(plan, version, key)

    @ray.method(concurrency_group="sync")
    def receive_part(self, version: int, bucket: int, rank: int, handle, nbytes: int, digest: int) -> int:
        return self.engine.sync.receive(version, bucket, rank, handle, nbytes, digest)

    @ray.method(concurrency_group="sync")
    def commit(self, version: int, probe_tokens: list[int], expected, rehearsal: bool = False) -> CommitResult:
        """`expected`: the learner's probe reference, or a one-item list of the ObjectRef it will arrive in (a list,
        so that Ray hands the reference over instead of waiting for it before the write starts)."""
        if isinstance(expected, list) and len(expected) == 1 and isinstance(expected[0], ray.ObjectRef):
            expected = functools.partial(ray.get, expected[0], timeout=self.engine.sync_cfg.timeout_s)
        try:
            return self.engine.sync.commit(version, probe_tokens, expected, rehearsal)
        except Exception:
            raise
        except BaseException as err:  # the write broke off with layers of two versions: this engine must go
            end_process(f"writing weight version {version} broke off ({type(err).__name__})")
