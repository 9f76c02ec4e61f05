"""Ray actor owning one vLLM engine (rlpipe/rollout.py does the work).

Generation and weight sync run in separate concurrency groups (one thread each), so buckets of the next version
arrive while the engine generates, and a sync requested mid-generation is handled per `sync.on_generation`.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import ray

from rlpipe.config import KernelsConfig, RolloutConfig, SyncConfig
from rlpipe.logs import LogSetup, configure_worker
from rlpipe.tpu_env import keep_only_given_tpu_env
from rlpipe.models.hf import read_hf_config
from rlpipe.rollout import RolloutEngine
from rlpipe.types import Completion, Prompt
from rlpipe.weightsync import SyncPlan


@ray.remote(concurrency_groups={"sync": 1})
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
    ):
        keep_only_given_tpu_env()  # also where Ray was started without rlpipe's job environment (actors/cluster.py)
        if log is not None:  # before vLLM is imported: its import logs too
            tied = bool(read_hf_config(model_path).get("tie_word_embeddings", False))
            configure_worker(replace(log, tied_output_layer=tied), vllm=True)
        progress_bars = log is None or log.verbose  # vLLM's bar for loading the weights
        self.engine = RolloutEngine(
            model_path, cfg, seed, tokenizer_path, sync, kernels=kernels, progress_bars=progress_bars
        )

    def generate(self, prompts: list[Prompt], n: int, **sampling) -> list[list[Completion]]:
        return self.engine.generate(prompts, n, **sampling)

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        return self.engine.sequence_logprobs(token_ids)

    def probe_by_decoding(self) -> bool:
        return self.engine.probe_by_decoding

    def policy_version(self) -> int:
        return self.engine.policy_version

    def seed(self, seed: int) -> None:
        self.engine.seed(seed)

    @ray.method(concurrency_group="sync")
    def held_version(self) -> int:
        """The policy version, answered even while a generation runs (a liveness check as well)."""
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
    def begin_sync(self, plan: SyncPlan, version: int) -> None:
        self.engine.sync.begin(plan, version)

    @ray.method(concurrency_group="sync")
    def receive_part(self, version: int, bucket: int, rank: int, handle, nbytes: int, digest: int) -> int:
        return self.engine.sync.receive(version, bucket, rank, handle, nbytes, digest)

    @ray.method(concurrency_group="sync")
    def commit(self, version: int, probe_tokens: list[int], expected, rehearsal: bool = False) -> dict:
        """`expected`: the learner's probe reference, or a one-item list of the ObjectRef it will arrive in (a list,
        so that Ray hands the reference over instead of waiting for it before the write starts)."""
        if isinstance(expected, list) and len(expected) == 1 and isinstance(expected[0], ray.ObjectRef):
            expected = functools.partial(ray.get, expected[0], timeout=self.engine.sync_cfg.timeout_s)
        return self.engine.sync.commit(version, probe_tokens, expected, rehearsal)
