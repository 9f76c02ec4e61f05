"""The driver's side of the weight sync, its one owner: the plan, the routes, the transport's set-up (shared buffers,
its process group), the start-up rehearsal, when the learner computes the probe, the transfer of each version with
its retries, and admitting an engine the pool started again.

One version's path: the driver asks every engine to `begin_sync`; every learner rank streams its shards, bucket by
bucket, through its transport and tells each engine about each part (`receive_part`, checked on arrival); the
learner ranks compute their answer to the probe; each engine `commit`s (writes, probes, keeps or rolls back); the
learner ranks release the version's buffers. See docs/architecture.md.

Every call of a sync has a deadline derived from `sync.timeout_s`. An attempt that fails (an error, or a deadline
passed) asks every engine whether it still serves (`alive`, answered apart from the sync): one that is dead, does
not answer or cannot serve is replaced and brought to the version; otherwise the attempt is repeated up to
`sync.retries` times, after a wait that doubles each time (`sync.retry_backoff_s`, at most
`sync.retry_backoff_max_s`), and then the run stops as a lost worker (`rlpipe train --auto-resume` restarts it).
Every repeated attempt is counted (`retries`, the run's `retries/sync` metric).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from rlpipe.actors.calls import CallTimeout, WorkerLost, backoff_s, get_all, reason, settle
from rlpipe.actors.engine_pool import EnginePool
from rlpipe.config import ConfigError, SyncConfig
from rlpipe.types import Group
from rlpipe.weightsync import DECODE_TOKENS, NonFiniteWeights, SyncError, SyncPlan, plan_routes, plan_sync
from rlpipe.weightsync.codec import new_sync_key
from rlpipe.weightsync.receiver import CommitResult

# After a failed attempt, how long its calls still running are waited for (their errors are dropped).
_SETTLE_S = 10.0
# The longest wait for an engine's answer to the liveness check after a failed attempt.
_ALIVE_S = 60.0


class SyncChannel:
    """Made when the roles are placed, before any actor starts (a route the cluster cannot take fails there);
    `open` sets it up once the learner ranks and the engines run. `cfg` is the `sync` section; `max_model_len`
    the engines' context (a decoded probe must fit in it). `version` is the policy version every engine serves.
    `generation_wait_s`: how long an engine's commit may wait for a generation in flight before it writes (the
    engines generate during a sync in asynchronous mode, and `sync.on_generation: finish` lets them finish)."""

    def __init__(
        self, cfg: SyncConfig, max_model_len: int, learner_hosts: list[str], pool: EnginePool,
        note: Callable[[str], None], generation_wait_s: float = 0.0,
    ):
        self.cfg, self.max_model_len, self.pool, self.note = cfg, max_model_len, pool, note
        self.generation_wait_s = generation_wait_s
        self.buckets = 1  # buckets of the plan, each sent within sync.timeout_s
        self.learner_hosts = learner_hosts
        self.routes = plan_routes(cfg.transport, learner_hosts, pool.hosts())
        self.learners: list = []
        self.version = 0
        self.plan = None  # the SyncPlan, in the object store (every send and begin_sync reads it)
        # The secret the parts' checksums are keyed with: an argument of every version's calls to the learner ranks
        # and engines, which Ray carries inside the call's message (arguments this small are inlined, not put in the
        # object store), so it is never in a file, a segment or the object store another user might read.
        self.key = new_sync_key()
        self.probe_by_decoding = False
        self.probe_tokens: list[int] = []
        self.rehearsal: dict[str, float] = {}
        self.vocab_size = 0  # the engines' vocabulary, from their layout
        self.retries = 0  # attempts repeated so far, over every version
        self.sleep = time.sleep  # the wait between attempts (tests hand in one that only records it)

    def open(self, learners: list, version: int) -> dict[str, float]:
        """Set the channel up between `learners` (the ranks, in order) and the pool's engines, the learner holding
        `version`, and send that version through it once (see `_rehearse`); returns the rehearsal's metrics."""
        self.learners, self.version = learners, version
        # Engines that cannot replay a sequence check each sync by decoding (rlpipe/weightsync/probe.py).
        self.probe_by_decoding = self._wait([self.pool.engines[0].probe_by_decoding.remote()], "rollout engine 0",
                                            "probe_by_decoding")[0]
        plan = self._plan()
        self.buckets = len(plan.buckets)
        self.plan = ray.put(plan)
        self._set_routes()
        self._share_buffers()
        self._connect()
        # The embedding's rows; a plan of adapters alone has no embedding, and the engine's vocabulary serves.
        vocab = plan.shapes.get("model.embed_tokens.weight", (self.vocab_size,))[0]
        self.probe_tokens = [(index * 7919) % vocab for index in range(1, 33)]  # any fixed sequence serves
        self.rehearsal = self._rehearse()
        return self.rehearsal

    def _plan(self) -> SyncPlan:
        """The transfer plan, computed once; checked against every engine's parameters so that a layout the
        engine does not expect fails here, before any weight is written."""
        shapes = self._wait([self.learners[0].weight_shapes.remote()], "learner rank 0", "weight_shapes")[0]
        layouts = self._wait([engine.layout.remote() for engine in self.pool.engines], "a rollout engine", "layout")
        plan = plan_sync(shapes, len(self.learners), layouts[0][0], int(self.cfg.bucket_mb * 2**20))
        self.vocab_size = layouts[0][0].vocab_size
        # Engines that take adapters load them by their names through vLLM's LoRA support, not into parameters
        # of their own: only whole weights are checked against the engines' parameters.
        into_params = not self.pool.form.adapters
        for index, (layout, params) in enumerate(layouts):
            unknown = sorted(plan.engine_params() - set(params)) if into_params else []
            if layout != layouts[0][0] or unknown:
                raise SyncError(
                    f"rollout engine {index} does not have the layout the sync plan expects "
                    f"(unknown parameters: {unknown[:3]}{'...' if len(unknown) > 3 else ''})"
                )
        return plan

    # ------------------------------------------------------------------ the transport's set-up

    def _set_routes(self, engines: list[int] | None = None) -> None:
        """Tell each side of every pair its route; `engines`: only these engines (the learner ranks' routes did not
        change)."""
        whole = self.routes.whole_buckets
        calls = [] if engines is not None else [
            learner.set_sync_routes.remote(self.routes.to_engines(rank), whole)
            for rank, learner in enumerate(self.learners)
        ]
        indexes = range(len(self.pool.engines)) if engines is None else engines
        calls += [self.pool.engines[index].set_sync_routes.remote(self.routes.from_ranks(index), whole)
                  for index in indexes]
        self._wait(calls, "a learner rank or rollout engine", "set_sync_routes")

    def _share_buffers(self) -> None:
        """Every learner rank writes into the buffers rank 0 names, where the transport shares them (shared memory
        with every pair on one host)."""
        prefix = self._wait([self.learners[0].sync_buffer_prefix.remote()], "learner rank 0", "sync_buffer_prefix")[0]
        self._wait([learner.share_sync_buffers.remote(prefix) for learner in self.learners], "a learner rank",
                   "share_sync_buffers")

    def _connect(self) -> None:
        """The transport's own process group, where it has one (gloo): learner ranks, then engines. Formed again, by
        everyone, when an engine is replaced (a gloo group cannot take in a new member)."""
        ranks = len(self.learners)
        address, port = self._wait([self.learners[0].rendezvous_address.remote()], "learner rank 0",
                                   "rendezvous_address")[0]
        world = ranks + len(self.pool.engines)
        self._wait(
            [learner.join_sync_process_group.remote(address, port, world) for learner in self.learners]
            + [
                engine.join_sync_process_group.remote(address, port, ranks + index, ranks, world)
                for index, engine in enumerate(self.pool.engines)
            ],
            "a learner rank or rollout engine", "join_sync_process_group",
        )

    def _join(self, index: int) -> None:
        """Engine `index` was started again (maybe on another host, its old one lost): its routes, and everyone's
        when they changed, and the transport's group formed anew."""
        previous = self.routes
        try:
            self.routes = plan_routes(self.cfg.transport, self.learner_hosts, self.pool.hosts())
        except ConfigError as err:  # a forced shm, and the engine had to move to another host
            raise WorkerLost(f"rollout engine {index} was restarted on another host: {err}") from None
        if self.routes == previous:
            self._set_routes(engines=[index])
        else:
            self.note(f"weight sync routes changed: {self.routes.counts()}")
            self._set_routes()
            self._share_buffers()
        self._connect()

    def admit(self, index: int) -> None:
        """Bring engine `index`, just started again by the pool, into the channel and to the version every engine
        serves: the learner still holds exactly those weights whenever this runs (between a sync and the next
        training step)."""
        self._join(index)
        if self.version > 0:  # version 0 is what the new engine loaded from the model folder
            self._transfer(self.version, self.probe_tokens, engines=[index])

    # ------------------------------------------------------------------ versions

    def _rehearse(self) -> dict[str, float]:
        """Send the starting weights through the whole channel once — transfer, write, probe — before training:
        a transport or layout that does not work fails here rather than after the first training step, the first
        sync does not pay for first-touch buffers, and the engines keep what arrived as their rollback copy.
        The engines already hold these weights, so the policy version stays 0; a resumed run's engines do not, so
        there the transfer is a real one, of the checkpoint's version."""
        if self.version:  # resumed: the engines must take the checkpoint's weights, as that version
            metrics, _ = self._transfer(self.version, self.probe_tokens)
        else:
            metrics, _ = self._transfer(1, self.probe_tokens, rehearsal=True)
        return metrics

    def push(self, probe: Group) -> dict[str, float]:
        """Push the learner's weights to every engine as the next policy version, verified.

        Each learner rank streams its own shards, bucket by bucket; each engine checks every bucket's checksum,
        then writes the version and replays one sampled sequence, which must give the learner's logprobs
        (`sync/probe_max_abs`) or the engine rolls back and the step fails. `sync/policy_shift` shows how far the
        logprobs moved from those the engine reported when it sampled, so a sync that silently did nothing
        cannot pass unnoticed.
        """
        version = self.version + 1
        completion = probe.completions[0]
        prompt = completion.prompt_ids or probe.prompt.token_ids  # an episode's prompt holds its tools
        # Replayed with one token to generate, the sequence must fit the engine's context: an episode whose prompt
        # (its tools' schemas) left no room ended empty, and is replayed cut to what fits.
        metrics, results = self._transfer(version, (prompt + completion.token_ids)[: self.max_model_len - 1])
        self.version = version
        sampled = completion.mask or [1] * len(completion.token_ids)  # an episode's tool tokens were not sampled
        metrics["sync/policy_shift"] = max(
            (abs(a - b) for a, b, m in zip(results[0].probe[len(prompt):], completion.logprobs, sampled) if m),
            default=0.0,
        )
        return metrics

    def _transfer(
        self, version: int, probe_tokens: list[int], rehearsal: bool = False, engines: list[int] | None = None
    ) -> tuple[dict[str, float], list[CommitResult]]:
        """Stream the learner's weights to the engines (all, or those indexed by `engines`) as `version`, then write
        and check them there. An engine that dies on the way (or stops answering, or can no longer serve) is
        replaced and the transfer repeated for the engines that have not committed the version; the others keep it.
        An attempt that fails with every engine alive is repeated up to `sync.retries` times, then the run stops
        (WorkerLost)."""
        # The learner's probe logprobs (all ranks compute them: the model is sharded). Where no engine shares a host
        # with a learner rank they are computed during the first attempt, while the engines write; on a shared host
        # the two would compete for its cores, which costs more than one after the other (docs/benchmarks.md), so
        # they come first.
        if self.probe_by_decoding:  # the continuation must fit in the engine's context
            probe_tokens = probe_tokens[: self.max_model_len - DECODE_TOKENS]
        expected, reference_s = None, None
        if self.routes.shared_host:
            started = time.perf_counter()
            expected = self._wait([learner.probe_reference.remote(probe_tokens, self.probe_by_decoding)
                                   for learner in self.learners], "a learner rank", "probe_reference")[0]
            reference_s = time.perf_counter() - started
        targets = list(range(len(self.pool.engines))) if engines is None else list(engines)
        failures = 0
        while True:
            try:
                metrics, results, expected = self._transfer_to(version, probe_tokens, expected, rehearsal, targets)
                if reference_s is not None:  # the learner's probe forward, before the transfer: part of the phase
                    metrics["sync/reference_s"] = reference_s
                return metrics, results
            # RayTaskError: an engine refused the version (a checksum, the probe) or a learner's send failed.
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, CallTimeout) as err:
                if isinstance(getattr(err, "cause", None), NonFiniteWeights):  # the same weights would fail again
                    raise NonFiniteWeights(reason(err)) from None
                lost = self.lost_engines(targets)
                if lost:
                    for index in lost:
                        if self.pool.replace(index, self.pool.engines[index], err):
                            self._join(index)  # the repeated transfer brings it to `version`
                elif not self._learners_alive():
                    raise WorkerLost(f"a learner rank died or stopped answering during a weight sync "
                                     f"({reason(err)})") from err
                else:
                    failures += 1
                    if failures > self.cfg.retries:
                        raise WorkerLost(f"weight sync v{version} failed {failures} times (sync.retries="
                                         f"{self.cfg.retries}), the last time: {reason(err)}") from err
                    wait_s = backoff_s(failures, self.cfg.retry_backoff_s, self.cfg.retry_backoff_max_s)
                    self.note(f"weight sync v{version} failed ({reason(err)}); trying again in {wait_s:g} s "
                              f"({failures} of {self.cfg.retries})")
                    self.sleep(wait_s)
                self.retries += 1
                if not rehearsal:
                    held = self._wait([self.pool.engines[index].held_version.remote() for index in targets],
                                      "a rollout engine", "held_version")
                    targets = [index for index, version_held in zip(targets, held) if version_held < version]
                    if not targets:  # every engine serves the version, yet a step after their commits failed
                        raise WorkerLost(f"weight sync v{version} failed after every engine took it: {reason(err)}")

    def lost_engines(self, indexes: list[int]) -> list[int]:
        """Those of the engines `indexes` that died, do not answer the liveness check (asked apart from the sync,
        so a write that hangs does not hide it), or answer that their engine can no longer serve."""
        calls = [(index, self.pool.engines[index].alive.remote()) for index in indexes]
        deadline = time.monotonic() + min(self.cfg.timeout_s, _ALIVE_S)
        lost = []
        for index, call in calls:
            try:
                if not ray.get(call, timeout=max(deadline - time.monotonic(), 0.0)):
                    lost.append(index)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                lost.append(index)
        return lost

    def _learners_alive(self) -> bool:
        try:
            ray.get([learner.policy_version.remote() for learner in self.learners],
                    timeout=min(self.cfg.timeout_s, _ALIVE_S))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False
        return True

    def _wait(self, refs: list, role: str, call: str, timeout_s: float | None = None) -> list:
        """The results of one step of the sync, within `timeout_s` (default sync.timeout_s)."""
        return get_all(refs, timeout_s or self.cfg.timeout_s, role, call, "sync.timeout_s")

    def _transfer_to(self, version, probe_tokens, expected, rehearsal, targets: list[int]):
        """One attempt of `_transfer`; returns its metrics, the engines' results and the learner's probe logprobs.
        Without `expected` the learner ranks compute them after sending, and the engines wait for them only to check
        their own replay of the probe."""
        handles = [self.pool.engines[index] for index in targets]
        timeout_s = self.cfg.timeout_s
        calls: list = []  # every call of this attempt: on failure, those still running are waited for
        done = False
        try:
            calls += [engine.begin_sync.remote(self.plan, version, self.key) for engine in handles]
            self._wait(calls, "a rollout engine", "begin_sync")
            started = time.perf_counter()
            sends = [learner.send_weights.remote(self.plan, version, handles, targets, self.key)
                     for learner in self.learners]
            probes = None if expected else [
                learner.probe_reference.remote(probe_tokens, self.probe_by_decoding) for learner in self.learners
            ]
            calls += sends + (probes or [])
            # Each bucket within sync.timeout_s (the learner ranks hold every receipt to it as well).
            sent = self._wait(sends, "a learner rank", "send_weights", timeout_s * (self.buckets + 1))
            transfer_s = time.perf_counter() - started
            reference = expected or [probes[0]]
            commits = [engine.commit.remote(version, probe_tokens, reference, rehearsal) for engine in handles]
            calls += commits
            # The write, the learner's probe reference, the probe and a rollback: each within sync.timeout_s; and the
            # generation in flight that the engine lets finish first.
            results: list[CommitResult] = self._wait(commits, "a rollout engine", "commit (write and probe)",
                                 3 * timeout_s + self.generation_wait_s)
            expected = expected or self._wait(probes, "a learner rank", "probe_reference")[0]
            done = True
        finally:
            if not done:  # their errors follow from the one raised; unwaited, Ray would print each
                settle(calls, _SETTLE_S)
            releases = [learner.release_weights.remote() for learner in self.learners]
            if done:
                self._wait(releases, "a learner rank", "release_weights")
            else:
                settle(releases, _SETTLE_S)
        metrics = {
            **self.routes.counts(),
            "sync/probe_max_abs": max(result.probe_max_abs for result in results),
            "sync/probe_mean_abs": max(result.probe_mean_abs for result in results),
            "sync/bytes": float(sum(sent)),
            "sync/transfer_s": transfer_s,
            "sync/write_s": max(result.write_s for result in results),
            "sync/probe_s": max(result.probe_s for result in results),
        }
        return metrics, results, expected

    def close(self) -> None:
        """Free the transport's buffers on the learner ranks (shared-memory segments are unlinked now rather than
        left to the resource tracker of a killed process)."""
        try:
            ray.get([learner.close_sync.remote() for learner in self.learners], timeout=30)
        except Exception:  # a dead or stuck learner must not keep the others alive
            pass
