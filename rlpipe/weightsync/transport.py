"""How a bucket part's bytes travel from a learner rank to the rollout engines: one interface, `Transport`, that every
transport implements whole, so that nothing outside this package asks which one it has.

Set-up, before the first transfer (and again when an engine is replaced), on both sides: `set_routes` (which pairs
take which route), `buffer_prefix` / `share_buffers` (learner ranks writing into rank 0's buffers), `connect` (a
process group of learner ranks and engines). A step that means nothing to a transport does nothing there.
Sender side (a learner rank), per part:  `buffer = allocate(nbytes, bucket, version)`, pack into it,
`handle, deliver = send(buffer)`, tell every engine about `handle`, then call `deliver()`.
Receiver side (an engine), per part:      `with receive(handle, source_rank, nbytes) as buffer:` read it.
After the version is committed the sender calls `release()`; `close()` frees everything for good. Before a
transfer the sender says which engines it goes to, `select(engine_indexes)`: usually all, one alone when a replaced
engine catches up (only gloo, which addresses receivers itself, needs to know).

Buffers are kept per bucket and reused by later versions: touching freshly mapped memory costs a page fault per
4 KiB, which would otherwise make first-touch buffers, not the copies, the bulk of a sync (docs/benchmarks.md).
Shared memory sets up both of its segment sets with the first version, faulted in on every side (see
SharedMemoryTransport).

An engine copies every part out of what `receive` yields, checking it as it copies (`Staging`): nothing it writes
later is read from a transport's buffer.

- `ray`:  the Ray object store (default; works across hosts). The handle is an object reference.
- `shm`:  POSIX shared memory on one host. The learner packs straight into a named segment; the handle is its name
          and that of the bucket's segment for the other versions (`SegmentHandle`). Every learner rank writes its
          rows of a bucket into the same segment, laid out as whole tensors (`whole_buckets`), so the engine uses each
          tensor in place however many ranks sent it. The segments are named by learner rank 0's transport
          (`buffer_prefix()` there, `share_buffers(names)` on every rank before the first transfer): each name ends in
          bits keyed with a secret of rank 0's, so one segment's name tells nothing of another's; rank 0 unlinks them.
          Each is created 0600, and a process opening one another process created checks that it is the run's own
          (ownership.py).
- `auto`: per learner-rank/engine pair, `shm` where both are on one host and `ray` where they are not
          (routes.py decides, from where Ray placed them; `set_routes` tells each side). When every pair shares a
          host it is exactly `shm`; otherwise each rank sends its own part, from a segment of its own when some
          engine shares its host, and puts the same bytes in the object store when some engine does not.
- `gloo`: torch.distributed point-to-point over a process group of its own (learner ranks, then engines). Sends
          block until the engine receives, which is why the engines are told first and `deliver()` comes after.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import hashlib
import mmap
import os
import secrets
import struct
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import numpy as np
import torch

from rlpipe.orphans import remove_orphans
from rlpipe.weightsync.errors import SyncError
from rlpipe.weightsync.ownership import SHM_DIR, check_own_file

TRANSPORTS = ("auto", "ray", "shm", "gloo")


# Names of the segments this process created (and so registered with its resource tracker).
_created_here: set[str] = set()
_SEGMENT_PREFIX = "rlpipe-"  # then the creating process's id


def remove_orphaned_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink segments whose creating process is gone. A learner killed mid-run (SIGKILL, OOM) cannot free its
    segments, and they would hold up to two model copies of RAM until the next reboot. Unlinking is safe even
    if an engine still maps one: the memory lives until the last mapping goes."""
    return remove_orphans(directory, _SEGMENT_PREFIX, os.unlink)


def _nothing() -> None:
    return None


# madvise(2) advice that faults a whole mapping in in one call (Linux >= 5.14), for writing or for reading.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def populate(segment, created: bool) -> None:
    """Fault every page of `segment` into this process now, so that later copies into it and reads from it take
    no page fault; the contents are left as they are (another rank may be writing into the segment already).

    The process that `created` the segment gives the file its memory first (fallocate: a /dev/shm too small for it
    fails here, rather than with a SIGBUS at some later write) and maps it page by page for writing. The others
    find the pages there and map them for reading, which the kernel does 64 KiB at a time (fault-around) and, on a
    shared mapping, writable as well; both take a fraction of what the page faults of a first write would
    (docs/benchmarks.md). Without MADV_POPULATE_* (Linux < 5.14, other systems) one byte per page is read instead,
    which maps the same."""
    if segment.size == 0:
        return
    if created and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(segment._fd, 0, segment.size)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise RuntimeError(
                    f"shm weight transport: no room in /dev/shm for segment {segment.name} ({segment.size} bytes); "
                    "it holds two copies of the weights in rollout dtype (or use sync.transport=ray)"
                ) from err
            # another error: a file system without fallocate; the pages are allocated as they are mapped below
        except AttributeError:
            pass
    if sys.platform == "linux":
        try:
            segment._mmap.madvise(_MADV_POPULATE_WRITE if created else _MADV_POPULATE_READ)
            return
        except (AttributeError, OSError):  # EINVAL: a kernel without the advice
            pass
    pages = np.ndarray((segment.size,), dtype=np.uint8, buffer=segment.buf)[:: mmap.PAGESIZE]
    int(pages.max())  # reads every page; the value is not needed
    del pages  # a view left alive would keep close() from unmapping the segment


class Transport(abc.ABC):
    """One end of the weight channel, on a learner rank (the sender) or an engine (the receiver)."""

    name: str
    whole_buckets = False  # every rank's part of a bucket arrives in one buffer, rows in place (shared memory)

    def set_routes(self, routes: list[str], whole_buckets: bool) -> None:
        """The route of each of this side's pairs, "shm" or "ray" (routes.py); only `auto` chooses per pair."""

    def buffer_prefix(self) -> SegmentNames | None:
        """How the buffers every learner rank writes into are named, asked of rank 0; None where each rank sends its
        own."""
        return None

    def share_buffers(self, prefix: SegmentNames | None) -> None:
        """Write into the buffers `prefix` names (learner rank 0's `buffer_prefix()`); None: nothing is shared."""

    def connect(self, address: str, port: int, rank: int, learner_ranks: int, world: int, timeout_s: float) -> None:
        """Join the channel's own process group (learner ranks first, then engines); only gloo has one."""

    def select(self, engine_indexes: list[int]) -> None:
        """The engines the next transfer goes to; only gloo addresses receivers itself."""

    @abc.abstractmethod
    def allocate(self, nbytes: int, bucket: int, version: int) -> np.ndarray:
        """A buffer of `nbytes` to pack `bucket` of `version` into."""

    @abc.abstractmethod
    def send(self, buffer: np.ndarray) -> tuple[Any, Callable[[], None]]:
        """The handle engines receive `buffer` by, and the call that delivers it (after they were told)."""

    @abc.abstractmethod
    def receive(self, handle: Any, source_rank: int, nbytes: int) -> contextlib.AbstractContextManager[np.ndarray]:
        """The bytes `handle` names, sent by learner rank `source_rank`, readable inside the context."""

    def release(self) -> None:
        """The version was committed: its buffers may be reused."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free every buffer for good."""


class _BufferPool(Transport):
    whole_buckets = False  # each rank's part of a bucket travels in a buffer of its own

    def __init__(self) -> None:
        self._buffers: dict[object, np.ndarray] = {}

    def allocate(self, nbytes: int, bucket: int, version: int) -> np.ndarray:
        buffer = self._buffers.get(bucket)
        if buffer is None or buffer.nbytes != nbytes:
            buffer = self._buffers[bucket] = np.empty(nbytes, dtype=np.uint8)
        return buffer

    def close(self) -> None:
        self._buffers.clear()


class RayTransport(_BufferPool):
    """ray.put copies the packed buffer into the object store, so the buffer is free for the next version."""

    name = "ray"

    def send(self, buffer: np.ndarray) -> tuple[Any, Callable[[], None]]:
        import ray

        # Wrapped in a list so that Ray passes the reference through instead of resolving it on the way in.
        return [ray.put(buffer)], _nothing

    @contextlib.contextmanager
    def receive(self, handle: Any, source_rank: int, nbytes: int) -> Iterator[np.ndarray]:
        import ray

        yield ray.get(handle[0])  # zero-copy, read-only view of the object


@dataclass(frozen=True)
class SegmentNames:
    """How the segments of one set of learner ranks are named: `prefix` (the creating process's id first, which the
    orphan sweep reads, then random hex), then per bucket and version parity 16 hex digits keyed with `secret`.
    Someone who sees one segment in /dev/shm cannot tell the name of the next one and make it first. The secret goes
    from rank 0 to the other ranks over Ray, never into a file."""

    prefix: str
    secret: bytes = field(repr=False)

    @classmethod
    def new(cls) -> SegmentNames:
        return cls(f"{_SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}", secrets.token_bytes(16))

    def name(self, bucket: int, parity: int) -> str:
        tag = hashlib.blake2b(struct.pack("<QQ", bucket, parity), key=self.secret, digest_size=8).hexdigest()
        return f"{self.prefix}-{tag}"


class SegmentHandle(NamedTuple):
    """What an engine is told of a part sent over shared memory: the segment it lies in, and the bucket's segment for
    the versions of the other parity, which the engine maps ahead (names cannot be derived from one another)."""

    name: str
    partner: str


class SharedMemoryTransport(Transport):
    """Segments live for the whole run, one per bucket and version parity. Both parities of a bucket are created
    the first time the bucket is allocated and faulted in (`populate`) everywhere: by the rank that created the
    segment at once, by the other sender ranks when the version is released, and by the receiver, which maps the
    other parity as soon as it first sees a bucket's segment; every mapping stays open until close(). A fresh
    segment otherwise costs a page fault per 4 KiB written (the kernel allocates, zeroes and maps each page) and
    one per 64 KiB read, and since consecutive versions alternate parities, the first two syncs of a run would each
    pay that once (several times a mapped sync's cost: docs/benchmarks.md). Instead the first sync, the start-up
    rehearsal in a run, sets both sets up, and every later one takes no page fault."""

    name = "shm"
    whole_buckets = True

    def __init__(self) -> None:
        self._segments: dict[tuple[int, int], Any] = {}  # sender: (bucket, parity) -> segment
        self._by_address: dict[int, tuple[int, int]] = {}  # sender: buffer address -> (bucket, parity)
        self._attached: dict[str, tuple[Any, np.ndarray]] = {}  # receiver: name -> (segment, view)
        self._names = SegmentNames.new()
        self._owner = True  # unlinks the segments; the other ranks only map them
        self.segments_opened = 0  # segments this process created or attached to, sending or receiving
        self._unpopulated: list[Any] = []  # sender: segments another rank created, to map after this version

    def buffer_prefix(self) -> SegmentNames:
        return self._names

    def share_buffers(self, prefix: SegmentNames | None) -> None:
        """Write into the segments `prefix` names (learner rank 0's `buffer_prefix()`)."""
        if prefix is None:
            return
        if self._segments:
            raise RuntimeError("shm weight transport: share_buffers() after the first transfer")
        self._names, self._owner = prefix, prefix == self._names

    def allocate(self, nbytes: int, bucket: int, version: int) -> np.ndarray:
        key = (bucket, version % 2)
        segment = self._segments.get(key)
        if segment is None:
            if not self._segments:
                remove_orphaned_segments()
            # This version's segment first, then the next version's, both complete before any handle leaves this
            # rank: the receiver may map the other parity as soon as it sees the first.
            for parity in (version % 2, 1 - version % 2):
                if (bucket, parity) in self._segments:  # set up by an allocation that failed half-way
                    continue
                opened, created = self._open(self._names.name(bucket, parity), max(1, nbytes))
                self._segments[(bucket, parity)] = opened  # before populating, so that close() frees it whatever happens
                if created:
                    populate(opened, created=True)
                else:  # the rank creating it is populating it now: mapped after this version (release)
                    self._unpopulated.append(opened)
            segment = self._segments[key]
        if segment.size < nbytes:
            raise RuntimeError(f"shm weight transport: segment {segment.name} holds {segment.size} bytes, "
                               f"bucket {bucket} needs {nbytes} (the sync plan changed)")
        buffer = np.ndarray((nbytes,), dtype=np.uint8, buffer=segment.buf)
        self._by_address[buffer.ctypes.data] = key
        return buffer

    def _open(self, name: str, nbytes: int) -> tuple[Any, bool]:
        """The segment `name`, created by whichever rank gets there first, and whether it was this one; only the
        owner keeps it registered with its resource tracker (which would unlink it when that process exits)."""
        from multiprocessing import shared_memory

        try:  # created with mode 0600
            segment, created = shared_memory.SharedMemory(create=True, size=nbytes, name=name), True
        except FileExistsError:
            segment, created = self._attach_when_sized(name, nbytes), False
        self.segments_opened += 1
        if self._owner:
            _created_here.add(segment.name)
        else:
            _untrack(segment)
        return segment, created

    @staticmethod
    def _attach_when_sized(name: str, nbytes: int, timeout_s: float = 30.0):
        """Another rank creates a segment in two steps (create, then set its size): wait for the second."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                segment = attach_own_segment(name)
                if segment.size >= nbytes:
                    return segment
                segment.close()
            except ValueError:  # "cannot mmap an empty file": created, not sized yet, or someone else's
                path = os.path.join(SHM_DIR, name)
                check_own_file(os.stat(path), path)
            if time.monotonic() > deadline:
                raise RuntimeError(f"shm weight transport: segment {name} did not reach {nbytes} bytes "
                                   f"within {timeout_s:.0f} s (the rank creating it stalled?)")
            time.sleep(0.001)

    def send(self, buffer: np.ndarray) -> tuple[Any, Callable[[], None]]:
        bucket, parity = self._by_address[buffer.ctypes.data]
        partner = self._segments[(bucket, 1 - parity)]  # allocate() sets both up
        return SegmentHandle(self._segments[(bucket, parity)].name, partner.name), _nothing

    @contextlib.contextmanager
    def receive(self, handle: Any, source_rank: int, nbytes: int) -> Iterator[np.ndarray]:
        name = handle.name
        if name not in self._attached:
            self._attach(name)
            # The bucket's other parity carries the next version: mapped and faulted in now, with this one.
            with contextlib.suppress(FileNotFoundError, ValueError):  # gone already, or not sized yet
                self._attach(handle.partner)
        segment, view = self._attached[name]
        # Reading a mapped page past the file's end (a segment truncated since it was mapped) is SIGBUS.
        size = os.fstat(segment._fd).st_size
        if size < nbytes:
            raise SyncError(f"weight sync: shared-memory segment {name} holds {size} bytes, {nbytes} expected "
                            "(truncated under the receiver)")
        yield view[:nbytes]

    def _attach(self, name: str) -> None:
        if name in self._attached:
            return
        segment = attach_own_segment(name)
        if name not in _created_here:  # the learner owns it (see attach_own_segment)
            _untrack(segment)
        populate(segment, created=False)
        self.segments_opened += 1
        self._attached[name] = (segment, np.ndarray((segment.size,), dtype=np.uint8, buffer=segment.buf))

    def release(self) -> None:
        """The version is done; its segments are reused by the one after next (close() frees them). Segments
        another rank created are faulted in now, when their creator has surely finished allocating them: done
        while it allocates, every 4 KiB page would be faulted separately, and each rank would take as long as
        the creator (docs/benchmarks.md)."""
        for segment in self._unpopulated:
            populate(segment, created=False)
        self._unpopulated.clear()

    def close(self) -> None:
        for segment, view in self._attached.values():
            del view
            with contextlib.suppress(BufferError):
                segment.close()
        self._attached.clear()
        self._by_address.clear()
        self._unpopulated.clear()
        for segment in self._segments.values():
            with contextlib.suppress(BufferError):  # a view may still be alive; unlinking frees it regardless
                segment.close()
            if self._owner:
                with contextlib.suppress(FileNotFoundError):
                    segment.unlink()
                _created_here.discard(segment.name)
        self._segments.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def attach_own_segment(name: str):
    """The existing segment `name`, once the file it maps is found to be the run's own (`check_own_file`): a
    segment another user made, or one group or others may use, is refused in one line naming it, and left as it
    is. Attaching registers the segment with this process's resource tracker (Python < 3.13), which would unlink
    it, or warn, when the process exits: only its creator keeps it registered (the callers unregister it)."""
    from multiprocessing import shared_memory

    path = os.path.join(SHM_DIR, name)
    try:
        segment = shared_memory.SharedMemory(name=name)
    except PermissionError:  # another user's, not open to this one
        raise SyncError(f"weight sync: shared-memory file {path} cannot be opened by the run's uid "
                        f"{os.geteuid()} (made by another user?); refusing to use it") from None
    try:
        check_own_file(os.fstat(segment._fd), path)
    except SyncError:
        _untrack(segment)  # never unlinked on this process's behalf: it is not the run's
        segment.close()
        raise
    return segment


def _untrack(segment) -> None:
    from multiprocessing import resource_tracker

    with contextlib.suppress(Exception):
        resource_tracker.unregister(segment._name, "shared_memory")


class AutoTransport(Transport):
    """`shm` or `ray` per pair. A learner rank's handle for a part carries what each kind of receiver needs (the
    segment name, the object reference); each engine reads it the way its route from that rank says."""

    name = "auto"

    def __init__(self) -> None:
        self._shm, self._ray = SharedMemoryTransport(), RayTransport()
        self._routes: list[str] = []  # sender: to each engine; receiver: from each learner rank
        self.whole_buckets = False

    def set_routes(self, routes: list[str], whole_buckets: bool) -> None:
        """The kind of each of this side's pairs (routes.py). A change (an engine replaced on another host) starts
        on fresh buffers; segments still viewed by an engine's rollback copy stay mapped (see `close`)."""
        if (whole_buckets != self.whole_buckets or set(routes) != set(self._routes)) and self._routes:
            self._shm.close()
            self._ray.close()
            self._shm = SharedMemoryTransport()
        self._routes, self.whole_buckets = list(routes), whole_buckets

    def buffer_prefix(self) -> SegmentNames | None:
        return self._shm.buffer_prefix() if self.whole_buckets else None

    def share_buffers(self, prefix: SegmentNames | None) -> None:
        if self.whole_buckets:
            self._shm.share_buffers(prefix)

    def allocate(self, nbytes: int, bucket: int, version: int) -> np.ndarray:
        if not self._routes:
            raise RuntimeError("auto weight transport used before set_routes()")
        pool = self._shm if "shm" in self._routes else self._ray
        return pool.allocate(nbytes, bucket, version)

    def send(self, buffer: np.ndarray) -> tuple[Any, Callable[[], None]]:
        handle = {}
        if "shm" in self._routes:
            handle["shm"] = self._shm.send(buffer)[0]
        if "ray" in self._routes:
            handle["ray"] = self._ray.send(buffer)[0]  # copies the bytes into the object store
        return handle, _nothing

    @contextlib.contextmanager
    def receive(self, handle: Any, source_rank: int, nbytes: int) -> Iterator[np.ndarray]:
        route = self._routes[source_rank]
        with (self._shm if route == "shm" else self._ray).receive(handle[route], source_rank, nbytes) as buffer:
            yield buffer

    def release(self) -> None:
        self._shm.release()
        self._ray.release()

    def close(self) -> None:
        self._shm.close()
        self._ray.close()


class GlooTransport(_BufferPool):
    """Point-to-point over a gloo group of M learner ranks (0..M-1) and E engines (M..M+E-1), separate from the
    learners' own group so that neither knows about the other's collectives."""

    name = "gloo"

    def __init__(self) -> None:
        super().__init__()
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self.group = None
        self.rank = -1
        self.learner_ranks = 0
        self.world = 0
        self.receivers: list[int] = []  # group ranks of the engines the next parts go to

    def connect(self, address: str, port: int, rank: int, learner_ranks: int, world: int, timeout_s: float) -> None:
        import torch.distributed as dist

        store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
        self.group = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))
        self.rank, self.learner_ranks, self.world = rank, learner_ranks, world
        self.receivers = list(range(learner_ranks, world))

    def select(self, engine_indexes: list[int]) -> None:
        self.receivers = [self.learner_ranks + index for index in engine_indexes]

    def send(self, buffer: np.ndarray) -> tuple[Any, Callable[[], None]]:
        if self.group is None:
            raise RuntimeError("gloo weight transport used before connect()")
        tensor = torch.from_numpy(buffer)

        def deliver() -> None:
            works = [self.group.send([tensor], engine, 0) for engine in self.receivers]
            for work in works:
                work.wait()

        return None, deliver

    @contextlib.contextmanager
    def receive(self, handle: Any, source_rank: int, nbytes: int) -> Iterator[np.ndarray]:
        if self.group is None:
            raise RuntimeError("gloo weight transport used before connect()")
        if self._scratch.numel() < nbytes:  # one receive at a time; its bytes are copied out before the next
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        buffer = self._scratch[:nbytes]
        self.group.recv([buffer], source_rank, 0).wait()
        yield buffer.numpy()


def make_transport(name: str) -> Transport:
    if name == "auto":
        return AutoTransport()
    if name == "ray":
        return RayTransport()
    if name == "shm":
        return SharedMemoryTransport()
    if name == "gloo":
        return GlooTransport()
    raise ValueError(f"sync.transport: unknown transport {name!r}; choose one of {', '.join(TRANSPORTS)}")
