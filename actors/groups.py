"""The roles as Ray actors: start them, spread work over them, sync weights, tear them down."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import ray
from ray._private import ray_constants

from rlpipe.actors.calls import get_all
from rlpipe.actors.learner import LearnerActor
from rlpipe.actors.placement import RoleGroup, place_role
from rlpipe.actors.reward import RewardActor
from rlpipe.actors.rollout import RolloutActor
from rlpipe.rewards import trainer_state as start_state
from rlpipe.config import Config, ConfigError, first_line
from rlpipe.device import learner_env, learner_processes
from rlpipe.environments import actors_needed, check_cluster_resources
from rlpipe.learner import combine_rank_metrics
from rlpipe.logs import LogSetup
from rlpipe.types import Completion, Group, Prompt, TrainBatch
from rlpipe.weightsync import DECODE_TOKENS, SyncError, SyncPlan, plan_routes, plan_sync

# glibc serves large blocks by mmap and gives freed memory back to the kernel, so every step faulted its
# activations and gradients in again, zeroed by the kernel: on this project's 2-core VM the learner spent
# 1.5-3.5 s a step in the kernel, 0.1-1 s with freed memory kept in the process. The thresholds hold for the main
# thread's heap only: other threads get arenas of their own, made of 64 MiB heaps that glibc unmaps as soon as
# they are empty (and blocks larger than that mmapped), whatever the thresholds. An engine runs its weight writes
# and generation on such threads (the actor's concurrency groups), and vLLM's reload allocates every layer anew:
# 83k page faults (0.34 GB) a sync, 0 with one arena for all threads, and the write 0.52 -> 0.39 s and
# 0.61 -> 0.33 s (SmolLM2-135M, two paired runs).
KEEP_FREED_MEMORY = (
    "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296:glibc.malloc.arena_max=1"
)


def compute_env() -> dict[str, str]:
    """The environment of the actors that compute (learner ranks, engines). Ray sets OMP_NUM_THREADS to an
    actor's logical CPU share (1); the roles take turns in synchronous mode, so each may use every core while it
    runs. Freed memory stays in the process, unless GLIBC_TUNABLES is already set (then it is left as it is)."""
    return {
        "OMP_NUM_THREADS": str(os.cpu_count() or 1),
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", KEEP_FREED_MEMORY),
    }


def start_ray(cfg: Config) -> None:
    """Join `ray.address`, or start a private local cluster bound to loopback."""
    if ray.is_initialized():
        return
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, log_to_driver=True)
        return
    # Ray rewrites a node address of 127.0.0.1 to the machine's outward address unless it runs in its
    # single-machine mode (the one it uses on macOS), which keeps every service on loopback. The flag is read
    # at import time: the environment carries it to Ray's own processes, the constant covers this one.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    # Token authentication on every service: Ray 2.60 turns it on for a new local cluster while RAY_AUTH_MODE is
    # unset (and writes a token to ~/.ray/auth_token if there is none). It is left to Ray rather than set here:
    # Ray caches the mode per process and refreshes that cache only when it sets the variable itself.
    auth_mode = os.environ.get("RAY_AUTH_MODE")
    if auth_mode is not None and auth_mode.lower() != "token":
        logging.getLogger("rlpipe").warning(
            "RAY_AUTH_MODE=%s: the local Ray cluster runs without token authentication", auth_mode
        )
    ray.init(
        address="local",  # never silently join a cluster named by RAY_ADDRESS
        num_cpus=cfg.ray.num_cpus or max(os.cpu_count() or 1, actors_needed(cfg)),
        include_dashboard=cfg.ray.dashboard,
        dashboard_host="127.0.0.1",
        dashboard_port=cfg.ray.dashboard_port,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
    )


class Roles:
    """Handles to the learner, the rollout engines and the reward workers."""

    def __init__(
        self,
        cfg: Config,
        model_path: str,
        tokenizer_path: str | None = None,
        resume: dict | None = None,
        note: Callable[[str], None] = print,
        reward_columns: list[str] | None = None,
        log: LogSetup | None = None,
    ):
        """`resume`: {"learner": directory of a checkpoint's learner state, "rng": each rank's RNG state or None}.
        `note`: where to report events worth a line in the run's log (an engine restarted).
        `reward_columns`: the dataset's columns every scored batch carries, checked against the reward functions'
        signatures when the reward workers start (None: not known here, see RewardRunner).
        `log`: how the actors log (rlpipe/logs.py), each tagged with its role and index; None leaves their logging
        as the libraries set it."""
        self.cfg, self.note, self.log = cfg, note, log
        self.reward_columns = reward_columns
        self.model_path, self.tokenizer_path = model_path, tokenizer_path
        self.engine_restarts = [0] * cfg.rollout.num_engines
        # An actor that cannot be placed waits forever; say so instead of hanging.
        check_cluster_resources(cfg, ray.cluster_resources())
        self.placements: list[RoleGroup] = []
        self.learners, self.engines, self.rewarders = [], [], []
        try:
            self._start(model_path, tokenizer_path, resume)
        except BaseException:  # release what did start: placement groups would otherwise hold the cluster
            self.shutdown()
            raise

    def _start(self, model_path: str, tokenizer_path: str | None, resume: dict | None) -> None:
        cfg = self.cfg
        ranks = learner_processes(cfg.learner.device, cfg.learner.ranks)
        learners = self._place(
            "learner", ranks, gpus_per_actor=1 if cfg.learner.device == "cuda" else 0, learner_device=cfg.learner.device
        )
        self.learner_placement = learners
        env = compute_env() | learner_env(cfg.learner.device, cfg.learner.ranks)
        self.engine_placement = self._place("rollout", cfg.rollout.num_engines, chips_per_actor=cfg.rollout.tensor_parallel)
        rewarders = self._place("reward", cfg.reward.num_workers)
        # Before any actor starts: a forced shm between hosts is refused here.
        self.routes = plan_routes(cfg.sync.transport, learners.hosts(), self.engine_placement.hosts())
        self.learners = [
            LearnerActor.options(**learners.options(rank, env)).remote(
                model_path, cfg, rank, ranks, self._log_setup("learner", rank)
            )
            for rank in range(ranks)
        ]
        self.engines = [self._new_engine(index) for index in range(cfg.rollout.num_engines)]
        specs = [asdict(spec) for spec in cfg.reward.functions]
        # Reward actors hold no state a step needs, so Ray restarts a dead one and re-runs its call there: the share
        # it was scoring is scored once, by the new process (tests/integration/test_grpo_e2e.py kills one).
        restarts = cfg.reward.max_restarts
        self.rewarders = [
            RewardActor.options(**rewarders.options(index), max_restarts=restarts, max_task_retries=restarts).remote(
                specs, cfg.reward.timeout_s, self.reward_columns, self._log_setup("reward", index)
            )
            for index in range(cfg.reward.num_workers)
        ]
        # Surface a bad model folder or reward path now rather than at the first step.
        get_all(
            [learner.policy_version.remote() for learner in self.learners]
            + [e.policy_version.remote() for e in self.engines]
            + [r.names.remote() for r in self.rewarders]
        )
        # Engines that cannot replay a sequence check each sync by decoding (rlpipe/weightsync/probe.py).
        self.probe_by_decoding = ray.get(self.engines[0].probe_by_decoding.remote())
        address, port = ray.get(self.learners[0].rendezvous_address.remote())
        get_all([learner.join_group.remote(address, port) for learner in self.learners])
        self.policy_version = 0
        if resume is not None:
            rngs = resume["rng"] if len(resume["rng"] or []) == ranks else [None] * ranks  # other M: fresh RNG
            versions = get_all(
                [learner.load_checkpoint.remote(resume["learner"], rng) for learner, rng in zip(self.learners, rngs)]
            )
            self.policy_version = versions[0]
        plan = self._plan_sync()
        self.sync_plan = ray.put(plan)
        self._set_sync_routes()
        self._share_sync_buffers()
        self._connect_sync_group()
        vocab = plan.shapes["model.embed_tokens.weight"][0]
        self.probe_tokens = [(index * 7919) % vocab for index in range(1, 33)]  # any fixed sequence serves
        self.rehearsal = self._rehearse_sync()

    def _new_engine(self, index: int):
        return RolloutActor.options(**self.engine_placement.options(index, compute_env())).remote(
            self.model_path, self.cfg.rollout, self.cfg.run.seed + index, self.tokenizer_path, self.cfg.sync,
            self._log_setup("rollout", index), self.cfg.model.kernels,
        )

    def _log_setup(self, role: str, index: int) -> LogSetup | None:
        return None if self.log is None else replace(self.log, who=f"{role}-{index}")

    def _set_sync_routes(self, engines: list[int] | None = None) -> None:
        """Tell each side of every pair its route (`sync.transport: auto`); `engines`: only these engines (the
        learner ranks' routes did not change)."""
        if self.routes.transport != "auto":
            return
        whole = self.routes.whole_buckets
        calls = [] if engines is not None else [
            learner.set_sync_routes.remote(self.routes.to_engines(rank), whole)
            for rank, learner in enumerate(self.learners)
        ]
        calls += [self.engines[index].set_sync_routes.remote(self.routes.from_ranks(index), whole)
                  for index in (range(len(self.engines)) if engines is None else engines)]
        get_all(calls)

    def _reroute(self, index: int) -> None:
        """After engine `index` was started again (maybe on another host, its old one lost): its routes, and
        everyone's when they changed."""
        previous = self.routes
        try:
            self.routes = plan_routes(self.cfg.sync.transport, self.learner_placement.hosts(), self.engine_placement.hosts())
        except ConfigError as err:  # a forced shm, and the engine had to move to another host
            raise WorkerLost(f"rollout engine {index} was restarted on another host: {err}") from None
        if self.routes == previous:
            self._set_sync_routes(engines=[index])
            return
        self.note(f"weight sync routes changed: {self.routes.counts()}")
        self._set_sync_routes()
        self._share_sync_buffers()

    def _share_sync_buffers(self) -> None:
        """Every learner rank writes into the shared-memory segments named by rank 0, one per bucket (whole buckets:
        every pair on shared memory)."""
        if self.routes.whole_buckets:
            prefix = ray.get(self.learners[0].sync_buffer_prefix.remote())
            get_all([learner.share_sync_buffers.remote(prefix) for learner in self.learners])

    def _connect_sync_group(self) -> None:
        """The gloo transport's own process group: learner ranks, then engines. Formed again, by everyone, when an
        engine is replaced (a gloo group cannot take in a new member)."""
        if self.cfg.sync.transport != "gloo":
            return
        ranks = len(self.learners)
        address, port = ray.get(self.learners[0].rendezvous_address.remote())
        world = ranks + len(self.engines)
        get_all(
            [learner.connect_sync_group.remote(address, port, world) for learner in self.learners]
            + [
                engine.connect_sync_group.remote(address, port, ranks + index, ranks, world)
                for index, engine in enumerate(self.engines)
            ]
        )

    def where(self) -> dict[str, list[str]]:
        """The node id each actor runs on, as the actor itself reports it, per role in rank order."""
        def node_of(_actor) -> str:  # runs inside the actor
            return ray.get_runtime_context().get_node_id()

        return self._ask_every_actor(node_of)

    @staticmethod
    def hosts(placement: dict[str, list[str]]) -> dict[str, list[str]]:
        """The node addresses of `placement` (node ids per role, from `where`)."""
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        return {role: [addresses.get(node, node) for node in nodes] for role, nodes in placement.items()}

    def interpreters(self) -> dict[str, list[str]]:
        """The Python interpreter each actor runs under, as the actor itself reports it, per role in rank order."""
        def executable(_actor) -> str:  # runs inside the actor
            import sys

            return sys.executable

        return self._ask_every_actor(executable)

    def _ask_every_actor(self, question) -> dict[str, list]:
        roles = {"learner": self.learners, "rollout": self.engines, "reward": self.rewarders}
        return {role: get_all([h.__ray_call__.remote(question) for h in handles]) for role, handles in roles.items()}

    def _place(
        self, role: str, actors: int, chips_per_actor: int = 1, gpus_per_actor: int = 0, learner_device: str | None = None
    ) -> RoleGroup:
        group = place_role(
            role, getattr(self.cfg.placement, role), actors, self.cfg.ray.placement_timeout_s, chips_per_actor,
            gpus_per_actor, learner_device,
        )
        self.placements.append(group)
        return group

    def _rehearse_sync(self) -> dict[str, float]:
        """Send the starting weights through the whole channel once — transfer, write, probe — before training:
        a transport or layout that does not work fails here rather than after the first training step, the first
        sync does not pay for first-touch buffers, and the engines keep what arrived as their rollback copy.
        The engines already hold these weights, so the policy version stays 0; a resumed run's engines do not, so
        there the transfer is a real one, of the checkpoint's version."""
        if self.policy_version:  # resumed: the engines must take the checkpoint's weights, as that version
            metrics, _ = self._transfer(self.policy_version, self.probe_tokens)
        else:
            metrics, _ = self._transfer(1, self.probe_tokens, rehearsal=True)
        return metrics

    def _plan_sync(self) -> SyncPlan:
        """The transfer plan, computed once; checked against every engine's parameters so that a layout the
        engine does not expect fails here, before any weight is written."""
        shapes = ray.get(self.learners[0].weight_shapes.remote())
        layouts = get_all([engine.layout.remote() for engine in self.engines])
        plan = plan_sync(shapes, len(self.learners), layouts[0][0], int(self.cfg.sync.bucket_mb * 2**20))
        for index, (layout, params) in enumerate(layouts):
            unknown = sorted(plan.engine_params() - set(params))
            if layout != layouts[0][0] or unknown:
                raise SyncError(
                    f"rollout engine {index} does not have the layout the sync plan expects "
                    f"(unknown parameters: {unknown[:3]}{'...' if len(unknown) > 3 else ''})"
                )
        return plan

    def generate(self, prompts: list[Prompt], n: int, **sampling) -> list[Group]:
        return self.finish_generation(self.start_generation(prompts, n, **sampling))

    def start_generation(self, prompts: list[Prompt], n: int, **sampling) -> Generation:
        """Send the prompts, split evenly across the engines, and return at once (asynchronous mode keeps the
        engines generating the next step while the learner trains)."""
        parts, start = [], 0
        for index, (engine, share) in enumerate(zip(self.engines, _split(prompts, len(self.engines)))):
            if share:
                parts.append(Part(index, engine, range(start, start + len(share)), engine.generate.remote(share, n, **sampling)))
            start += len(share)
        return Generation(prompts, n, sampling, parts)

    def finish_generation(self, generation: Generation) -> list[Group]:
        """Collect the completions. An engine that died (killed, out of memory) is replaced and given the current
        weights, and only the prompts it held are generated again, so every prompt comes back exactly once. A prompt
        whose requests a weight sync aborted comes back empty; it is sampled again too, by the new policy."""
        completions: list[list[Completion]] = [[] for _ in generation.prompts]
        for part in generation.parts:
            try:
                for index, group in zip(part.prompts, ray.get(part.future)):
                    completions[index] = group
            except ray.exceptions.RayActorError as err:
                self._replace_engine(part.engine_index, part.engine, err, push_weights=True)
        retry = [index for index, group in enumerate(completions) if not group]
        if retry:
            again = self.generate([generation.prompts[i] for i in retry], generation.n, **generation.sampling)
            for index, group in zip(retry, again):
                completions[index] = group.completions
        return [Group(prompt, group) for prompt, group in zip(generation.prompts, completions)]

    def _replace_engine(self, index: int, dead, error: Exception, push_weights: bool) -> None:
        """Start a new engine in the place of `dead` (engine `index`), unless that was done already (several calls
        to one engine fail when it dies), and bring it to the pool's policy version: the learner still holds exactly
        those weights whenever this runs with `push_weights` (between a sync and the next training step). During a
        sync (`push_weights` False) the transfer in progress brings it to the new version instead."""
        if self.engines[index] is not dead:
            return
        self.engine_restarts[index] += 1
        if self.engine_restarts[index] > self.cfg.rollout.max_restarts:
            raise WorkerLost(
                f"rollout engine {index} died more than rollout.max_restarts={self.cfg.rollout.max_restarts} times "
                f"({first_line(error)})"
            )
        self.note(
            f"rollout engine {index} died ({first_line(error)}); starting it again "
            f"(restart {self.engine_restarts[index]} of at most {self.cfg.rollout.max_restarts})"
        )
        self._wait_for_room(index, dead)
        ray.kill(dead, no_restart=True)
        self.engines[index] = self._new_engine(index)
        ray.get(self.engines[index].policy_version.remote())  # started: the model is loaded
        self._reroute(index)
        self._connect_sync_group()
        if push_weights and self.policy_version > 0:  # version 0 is what the new engine loaded from the model folder
            self._transfer(self.policy_version, self.probe_tokens, engines=[index])

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
        if not self.engine_placement.group.wait(timeout_seconds=remaining):
            resources = dict(self.cfg.placement.rollout.resources)
            raise WorkerLost(
                f"rollout engine {index} lost its host and no live node has room for it (placement.rollout.resources "
                f"{resources}) within {timeout_s:g} s (ray.placement_timeout_s)"
            )

    def score(self, groups: list[Group], trainer_state: dict | None = None) -> tuple[dict[str, int], dict[str, str]]:
        """Fill each group's rewards; returns failures per reward function and the first error of each.
        `trainer_state`: what reward functions get as `trainer_state` (default: a run's start)."""
        state = dict(trainer_state or start_state())
        shares = [s for s in _split(groups, len(self.rewarders)) if s]
        futures = []
        for worker, share in zip(self.rewarders, shares):
            samples = [(g, c) for g in share for c in g.completions]
            columns = {key: [g.prompt.columns[key] for g, _ in samples] for key in share[0].prompt.columns}
            columns.update(
                completion_tokens=[len(c.token_ids) for _, c in samples],
                finish_reason=[c.finish_reason for _, c in samples],
                max_tokens=[self.cfg.rollout.max_tokens] * len(samples),
            )
            prompts, texts = [g.prompt.for_rewards for g, _ in samples], [c.text for _, c in samples]
            ids, sizes = [c.token_ids for _, c in samples], [len(g.completions) for g in share]
            futures.append(worker.score.remote(prompts, texts, columns, sizes, ids, state))
        failures: dict[str, int] = {}
        errors: dict[str, str] = {}
        try:
            results = ray.get(futures)
        except ray.exceptions.RayActorError as err:
            raise RuntimeError(
                f"a reward worker died more than reward.max_restarts={self.cfg.reward.max_restarts} times while "
                f"scoring ({str(err).splitlines()[0]})"
            ) from None
        for share, result in zip(shares, results):
            start = 0
            for group in share:
                window = slice(start, start + len(group.completions))
                group.rewards = result.totals[window]
                group.reward_parts = {name: values[window] for name, values in result.per_function.items()}
                start = window.stop
            for name, count in result.failures.items():
                failures[name] = failures.get(name, 0) + count
            for name, message in result.first_errors.items():
                errors.setdefault(name, message)
        return failures, errors

    def train(self, batch: TrainBatch) -> dict[str, float]:
        batch_ref = ray.put(batch)  # one copy in the object store, read by every rank
        try:
            return combine_rank_metrics(get_all([learner.train_step.remote(batch_ref) for learner in self.learners]))
        except ray.exceptions.RayActorError as err:  # the other ranks cannot go on without it: the step stops
            raise WorkerLost(f"a learner rank died during a training step ({first_line(err)})") from err

    def sync_weights(self, probe: Group) -> dict[str, float]:
        """Push the learner's weights to every engine as the next policy version, verified.

        Each learner rank streams its own shards, bucket by bucket; each engine checks every bucket's checksum,
        then writes the version and replays one sampled sequence, which must give the learner's logprobs
        (`sync/probe_max_abs`) or the engine rolls back and the step fails. `sync/policy_shift` shows how far the
        logprobs moved from those the engine reported when it sampled, so a sync that silently did nothing
        cannot pass unnoticed.
        """
        version = self.policy_version + 1
        completion = probe.completions[0]
        metrics, results = self._transfer(version, probe.prompt.token_ids + completion.token_ids)
        self.policy_version = version
        start = len(probe.prompt.token_ids)
        metrics["sync/policy_shift"] = max(
            (abs(a - b) for a, b in zip(results[0]["probe"][start:], completion.logprobs)), default=0.0
        )
        return metrics

    def _transfer(self, version: int, probe_tokens: list[int], rehearsal: bool = False, engines: list[int] | None = None):
        """Stream the learner's weights to the engines (all, or those indexed by `engines`) as `version`, then write
        and check them there. An engine that dies on the way is replaced and the transfer repeated for the engines
        that have not committed the version; the others keep it."""
        # The learner's probe logprobs (all ranks compute them: the model is sharded). Where no engine shares a host
        # with a learner rank they are computed during the first attempt, while the engines write; on a shared host
        # the two would compete for its cores, which on 2 cores cost more than one after the other
        # (docs/benchmarks.md), so they come first.
        if self.probe_by_decoding:  # the continuation must fit in the engine's context
            probe_tokens = probe_tokens[: self.cfg.rollout.max_model_len - DECODE_TOKENS]
        expected = None
        if self.routes.shared_host:
            expected = get_all([learner.probe_reference.remote(probe_tokens, self.probe_by_decoding)
                                for learner in self.learners])[0]
        targets = list(range(len(self.engines))) if engines is None else list(engines)
        while True:
            handles = [self.engines[index] for index in targets]
            try:
                metrics, results, expected = self._transfer_to(
                    version, probe_tokens, expected, rehearsal, targets, handles
                )
                return metrics, results
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:  # the latter: a learner's send
                dead = self._dead_engines(targets)
                if not dead:
                    if self._learners_alive():
                        raise
                    raise WorkerLost(f"a learner rank died during a weight sync ({first_line(err)})") from err
                for index in dead:
                    self._replace_engine(index, self.engines[index], err, push_weights=False)
                if not rehearsal:
                    done = get_all([self.engines[index].held_version.remote() for index in targets])
                    targets = [index for index, held in zip(targets, done) if held < version]

    def _learners_alive(self) -> bool:
        try:
            ray.get([learner.policy_version.remote() for learner in self.learners], timeout=60)
        except ray.exceptions.RayActorError:
            return False
        return True

    def _dead_engines(self, indexes: list[int]) -> list[int]:
        dead = []
        for index in indexes:
            try:
                ray.get(self.engines[index].held_version.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                dead.append(index)
        return dead

    def _transfer_to(self, version, probe_tokens, expected, rehearsal, targets: list[int], handles: list):
        """One attempt of `_transfer`; returns its metrics, the engines' results and the learner's probe logprobs.
        Without `expected` the learner ranks compute them after sending, and the engines wait for them only to check
        their own replay of the probe."""
        get_all([engine.begin_sync.remote(self.sync_plan, version) for engine in handles])
        started = time.perf_counter()
        try:
            plan = self.sync_plan
            sends = [learner.send_weights.remote(plan, version, handles, targets) for learner in self.learners]
            probes = None if expected else [
                learner.probe_reference.remote(probe_tokens, self.probe_by_decoding) for learner in self.learners
            ]
            sent = get_all(sends)
            transfer_s = time.perf_counter() - started
            reference = expected or [probes[0]]
            results = get_all([engine.commit.remote(version, probe_tokens, reference, rehearsal) for engine in handles])
            expected = expected or get_all(probes)[0]
        finally:
            get_all([learner.release_weights.remote() for learner in self.learners])
        metrics = {
            **self.routes.counts(),
            "sync/probe_max_abs": max(result["probe_max_abs"] for result in results),
            "sync/probe_mean_abs": max(result["probe_mean_abs"] for result in results),
            "sync/bytes": float(sum(sent)),
            "sync/transfer_s": transfer_s,
            "sync/write_s": max(result["write_s"] for result in results),
        }
        return metrics, results, expected

    def export(self, out_dir: str) -> str:
        return get_all([learner.export.remote(out_dir) for learner in self.learners])[0]

    def save_checkpoint(self, directory: str) -> list[str]:
        """Every learner rank writes its part of the learner state (in parallel); returns their RNG states."""
        try:
            return get_all([learner.save_checkpoint.remote(directory) for learner in self.learners])
        except ray.exceptions.RayActorError as err:  # the save is abandoned; a restart from the last one may go on
            raise WorkerLost(f"a learner rank died while writing a checkpoint ({first_line(err)})") from err

    def seed(self, step: int) -> None:
        """Seed every engine's sampling for this step (see RolloutEngine.seed)."""
        seeds = [self.cfg.run.seed * 1_000_003 + step * 1009 + index for index in range(len(self.engines))]
        calls = [(engine, engine.seed.remote(seed)) for engine, seed in zip(self.engines, seeds)]
        for index, (engine, call) in enumerate(calls):
            try:
                ray.get(call)
            except ray.exceptions.RayActorError as err:  # died since the last step: replaced, then seeded
                self._replace_engine(index, engine, err, push_weights=True)
                ray.get(self.engines[index].seed.remote(seeds[index]))

    def shutdown(self) -> None:
        # Unlink shared-memory segments now rather than leave them to the resource tracker of a killed process.
        try:
            ray.get([learner.close_sync.remote() for learner in self.learners], timeout=30)
        except Exception:  # a dead or stuck learner must not keep the others alive
            pass
        for handle in [*self.learners, *self.engines, *self.rewarders]:
            ray.kill(handle)
        for group in self.placements:
            group.remove()


class WorkerLost(RuntimeError):
    """A role's actor died and could not be replaced; a run restarted from its latest checkpoint may go on
    (`rlpipe train --auto-resume`)."""


@dataclass
class Part:
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
    parts: list[Part]


def _split(items: list, parts: int) -> list[list]:
    """Contiguous, near-equal shares, so results concatenate back in order."""
    base, extra = divmod(len(items), parts)
    shares, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        shares.append(items[start:stop])
        start = stop
    return shares
