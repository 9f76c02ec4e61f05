"""An engine's end of the weight-sync channel: begin a version, receive its parts, commit it (write, probe, keep it or
roll back). Nothing here knows vLLM: the engine hands in how it writes a version, how it answers the probe and how it
pauses generation, so the same receiver serves every engine and the sync benchmark."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ContextManager, Protocol

import torch

from rlpipe.config import first_line
from rlpipe.weightsync.errors import SyncError
from rlpipe.weightsync.layout import SyncPlan
from rlpipe.weightsync.probe import MEAN_PROBE_MAX_FACTOR, DecodedProbe, probe_gaps
from rlpipe.weightsync.staging import Staging
from rlpipe.weightsync.transport import Transport

Weights = dict[str, torch.Tensor]
ProbeResult = list[float] | DecodedProbe


class HostMemory(Protocol):
    """Shared memory the engine's workers read (`HostCopy`): staging assembles a version straight into it."""

    def staging_memory(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> Weights: ...

    def holds(self, tensor: torch.Tensor) -> bool: ...


@dataclass
class CommitResult:
    """A version an engine committed: the probe's largest and mean gap to the learner's log-probs, the seconds the
    write and the probe took, the bytes received, and the probe sequence's log-probs under the new weights (the
    engine's own, or the learner's where the engine decodes: `probe_gaps`)."""

    probe_max_abs: float
    probe_mean_abs: float
    write_s: float
    probe_s: float
    bytes: int
    probe: list[float]


@contextlib.contextmanager
def _not_paused() -> Iterator[None]:
    yield


class WeightReceiver:
    """Receives versions of the learner's weights for one engine and applies each only whole and checked.

    `write(weights)` puts a complete version into the engine (a write that raises may have written some layers:
    the previous version is written back). `probe(tokens)` is the engine's answer to the probe with the weights just
    written: its log-probs of `tokens` (position 0 gets 0.0), or a greedy continuation (`DecodedProbe`) where the
    engine cannot replay a sequence. `initial_weights()` loads version 0, what the engine started with, for rolling
    the first version back. `paused()` is a context during which the engine generates nothing: the write, the
    probe and a rollback run inside it. The probe passes when the gap to the learner's, its maximum over tokens
    (`exact`) or its mean, is at most `tolerance`; with the mean, no one token's gap may exceed
    `MEAN_PROBE_MAX_FACTOR` times `tolerance` either. Without `keep_previous` no copy is kept to roll back to, and a
    version that fails its check leaves the engine refusing to generate (`unusable`).

    Every part is copied out of the transport's buffer into the engine's own staging copy and checked there as it is
    copied (`Staging`): the engine writes from the very bytes that were checked. `host_memory()`, where given and not
    None (the engine's workers read a shared host copy), is where staging assembles every version, so the write
    hands the workers the staged tensors where they lie, copying nothing. Such a staging copy is a file other
    processes of the run's user can open, so once the write has read it (and the workers compared what they hold with
    it) it is checked against its checksums again, before the probe: a change made there after the part's check,
    before or during the write, fails the version and the previous one is written back. The version kept for rolling
    back is checked again before it is written back."""

    def __init__(
        self,
        transport: Transport,
        *,
        write: Callable[[Weights], None],
        probe: Callable[[list[int]], ProbeResult],
        initial_weights: Callable[[], Weights],
        tolerance: float,
        exact: bool,
        keep_previous: bool = True,
        paused: Callable[[], ContextManager] = _not_paused,
        host_memory: Callable[[], HostMemory | None] | None = None,
    ):
        self.transport = transport
        self._write, self._probe, self._initial_weights, self._paused = write, probe, initial_weights, paused
        self.tolerance, self.exact, self.keep_previous = tolerance, exact, keep_previous
        self.max_gap = MEAN_PROBE_MAX_FACTOR * tolerance  # where the mean is checked: no one token beyond this
        self.policy_version = 0
        self.unusable: str | None = None  # why the engine must not generate: a failed version and nothing to go back to
        self._host_memory = host_memory
        self._staging: Staging | None = None
        # The served version's tensors, for rolling back, the staging that checked them, the memory it owns, and
        # owned memory free for the next staging to write into.
        self._current_weights: Weights | None = None
        self._current_staging: Staging | None = None
        self._current_owned: Weights = {}
        self._spare_owned: Weights = {}

    def begin(self, plan: SyncPlan, version: int, key: bytes) -> None:
        """Start receiving `version`, its parts' checksums keyed with the run's secret `key`; an unfinished earlier
        staging is dropped."""
        if version <= self.policy_version:
            raise SyncError(f"weight version {version} is not newer than the engine's {self.policy_version}")
        if self._staging is not None:  # an abandoned version: its memory is free again
            self._spare_owned, self._staging = self._staging.owned, None
        memory = self._host_memory() if self._host_memory is not None else None
        reuse = self._spare_owned
        if memory is not None and not _fills(reuse, plan, memory):
            # Fresh shared memory for the whole version; the spare tensors (elsewhere, or of another plan) go.
            reuse = _host_staging(memory, plan)
        self._spare_owned = {}
        self._staging = Staging(plan, version, key, reuse=reuse, whole_buckets=self.transport.whole_buckets)

    def receive(self, version: int, bucket: int, rank: int, handle, nbytes: int, digest: int) -> int:
        """Take learner rank `rank`'s part of `bucket` from the transport and check it; returns its size."""
        staging = self._staging
        if staging is None or staging.version != version:
            raise SyncError(f"weight sync v{version}: a bucket arrived before begin_sync")
        with self.transport.receive(handle, rank, nbytes) as buffer:
            try:
                staging.add(bucket, rank, buffer, digest)
            except SyncError:
                self._staging = None  # a corrupt version is never applied, not even partly
                self._spare_owned = staging.owned
                raise
        return nbytes

    def commit(
        self,
        version: int,
        probe_tokens: list[int],
        expected: ProbeResult | Callable[[], ProbeResult],
        rehearsal: bool = False,
    ) -> CommitResult:
        """Apply a fully received version: pause generation, write, check the probe, resume.

        `expected` is the learner's answer to the probe, or a function that waits for it (the learner may compute it
        while the engine writes). A failed write or check writes the previous version back (or, without
        `keep_previous`, leaves the engine unusable); either way the engine never serves a mix of two versions. A
        `rehearsal` carries the weights the engine already serves (the channel's start-up check): written and checked
        the same way, but the policy version stays."""
        staging, self._staging = self._staging, None
        if staging is None or staging.version != version:
            raise SyncError(f"weight sync v{version}: nothing received for this version (a bucket failed?)")
        weights = staging.complete()
        with self._paused():
            started = time.perf_counter()
            probe, gap_max, gap_mean, failure = [], float("nan"), float("nan"), None
            write_s = probe_s = float("nan")
            try:
                self._write(weights)
                write_s = time.perf_counter() - started
                changed = staging.verify() if self._shared(staging) else None
                if changed is None:
                    measured = self._probe(probe_tokens)
                    probe_s = time.perf_counter() - started - write_s
                else:
                    failure = f"the staged copy another process can map changed since it was checked ({changed})"
            except Exception as err:  # a write that broke off may have left some layers new and some old
                failure = f"writing the weights failed ({type(err).__name__}: {err})"
            except BaseException as err:  # no rollback runs now: the engine may hold layers of two versions
                self.unusable = f"weight sync v{version}: the write broke off ({type(err).__name__})"
                raise
            if failure is None:
                try:
                    reference = expected() if callable(expected) else expected
                except Exception as err:  # the new weights cannot be checked, so they are not served
                    failure = f"the learner's probe logprobs did not arrive ({type(err).__name__}: {err})"
                else:
                    gaps, probe = probe_gaps(measured, reference)
                    gaps = gaps or [0.0]
                    gap_max, gap_mean = max(gaps), sum(gaps) / len(gaps)
            gap, statistic = (gap_max, "max") if self.exact else (gap_mean, "mean")
            bound, named = self.tolerance, f"sync.probe_tolerance {self.tolerance:g}"
            if not self.exact and gap_mean <= self.tolerance and not gap_max <= self.max_gap:
                # One token far off, which a long sequence's mean hides: a gross corruption (a weight blown up to
                # 1e36) that only a few of the probe's tokens see.
                gap, statistic, bound = gap_max, "max", self.max_gap
                named = f"{MEAN_PROBE_MAX_FACTOR:g} x sync.probe_tolerance {self.tolerance:g}"
            if failure or not gap <= bound:  # `not <=` also catches NaN
                self._spare_owned = staging.owned
                if failure is None and not math.isfinite(gap):
                    failure = ("after writing, the engine's probe logprobs are not finite (NaN or inf): the weights "
                               "as written make the model's outputs overflow")
                message = f"weight sync v{version}: " + (
                    failure
                    if failure
                    else f"after writing, the engine's probe logprobs differ from the learner's by {gap:.3g} "
                    f"({statistic} over tokens) > {named}"
                )
                if not self.keep_previous:
                    self.unusable = message + "; no previous weights were kept (sync.keep_previous: false)"
                    raise SyncError(self.unusable)
                self._roll_back(message)
            self._keep(weights, staging)
            if rehearsal and self.keep_previous and not self._spare_owned:
                self._prepare_spare(staging.plan)
            if not rehearsal:
                self.policy_version = version
            self.unusable = None
            return CommitResult(
                probe_max_abs=gap_max, probe_mean_abs=gap_mean, write_s=write_s, probe_s=probe_s,
                bytes=staging.bytes_received, probe=probe,
            )

    def _shared(self, staging: Staging) -> bool:
        """Whether `staging` lies in memory other processes can map (the engine's host copy in /dev/shm, which its
        workers read): then it is checked again once the write has read it. Memory of the engine's own (an
        in-process engine, workers that get bytes) no other process maps, so what was checked is what is written."""
        memory = self._host_memory() if self._host_memory is not None else None
        return memory is not None and any(memory.holds(tensor) for tensor in staging.owned.values())

    def _keep(self, weights: Weights, staging: Staging) -> None:
        """Keep what a rollback needs of the version now served (staging's own memory: the engine's copy, never a
        view of transport buffers), and recycle the memory the replaced version no longer needs."""
        if not self.keep_previous:
            self._spare_owned = staging.owned
            return
        self._spare_owned = self._current_owned
        self._current_owned, self._current_weights, self._current_staging = staging.owned, weights, staging

    def _prepare_spare(self, plan: SyncPlan) -> None:
        """Memory for the next version to be staged into, laid out like `plan` (where the engine's workers read it,
        if they do) and written once now, at the start-up check: otherwise the first version of training would fault
        in a whole copy of the weights, a page fault per 4 KiB, inside its step. The second copy is one the engine
        keeps anyway from that version on (`keep_previous`: the served version and the one arriving)."""
        memory = self._host_memory() if self._host_memory is not None else None
        if memory is not None:
            spare = _host_staging(memory, plan)
        else:
            spare = {name: torch.empty(tuple(shape), dtype=plan.torch_dtype) for name, shape in plan.shapes.items()}
        for tensor in spare.values():
            tensor.zero_()
        self._spare_owned = spare

    def _roll_back(self, failure: str) -> None:
        """Write the previous version back, once it checks out against the checksums it arrived with; raises."""
        previous = self._previous_weights()
        changed = self._current_staging.verify() if self._current_staging is not None else None
        if changed is not None:
            self.unusable = (f"{failure}; the copy of version {self.policy_version} kept for rolling back is corrupt "
                             f"({changed}), so the engine serves nothing until a version arrives whole")
            raise SyncError(self.unusable)
        try:
            self._write(previous)
        except Exception as err:  # layers of two versions again, and nothing left to write back
            self.unusable = (f"{failure}; writing version {self.policy_version} back failed too "
                             f"({type(err).__name__}: {first_line(err)})")
            raise SyncError(self.unusable) from None
        raise SyncError(failure + f"; the engine rolled back to version {self.policy_version}")

    def _previous_weights(self) -> Weights:
        if self._current_weights is None:  # version 0: what the engine loaded
            self._current_weights = self._initial_weights()
        return self._current_weights

    def close(self) -> None:
        """Free the transport's buffers."""
        self.transport.close()


def _host_staging(host: HostMemory, plan: SyncPlan) -> Weights:
    """Fresh memory in `host`'s shared memory for every tensor of `plan`."""
    return host.staging_memory({name: tuple(shape) for name, shape in plan.shapes.items()}, plan.torch_dtype)


def _fills(memory: Weights, plan: SyncPlan, host: HostMemory) -> bool:
    """Whether `memory` has a tensor of the right shape and dtype in `host`'s shared memory for every one of
    `plan`'s."""
    for name, shape in plan.shapes.items():
        tensor = memory.get(name)
        if tensor is None or tuple(tensor.shape) != tuple(shape) or tensor.dtype != plan.torch_dtype:
            return False
        if not host.holds(tensor):
            return False
    return True
