"""One host copy of a version for all the workers of an engine.

An engine's workers (vLLM's tensor-parallel processes on its host) each write their slice of every tensor. Sending
each of them the whole version through vLLM's RPC would place one full copy per worker on the host, plus the
serialized one. Instead the engine publishes the version once in shared memory and sends every worker a
`SharedWeights`: for each tensor only the file that holds it, its offset, dtype and shape — no tensor bytes.

- Where the workers read a host copy, staging assembles each version straight into a segment of the engine's (`HostCopy.staging_memory`, made when the version begins): its
  tensors are found there too, and nothing is copied. Such a segment lives while staging or the rollback copy
  uses its tensors (the engine's receiver reuses it for later versions), and is unlinked when the last goes or at
  `HostCopy.close`.
- The others (the weights the engine loaded, for a rollback to version 0) are written once into a segment of the engine's own, which lives only for the write: created, filled, read by the workers,
  unlinked when the write returns or fails (`HostCopy.publish`).

Every segment's name carries the engine process's id, so one left by an engine that died is removed by the next
one to start a sync, or by the next `shm` sender on the host (`remove_orphaned_segments`).

A worker maps each file privately (copy-on-write: the shared copy is never changed, whatever a loader does with
the tensors it is given), hands views of it to its loaders, which copy each into the worker's own tensors, and
drops the pages it has read every `chunk_bytes` (`read_shared_weights`): it never holds more than about one chunk
plus the tensor being copied of the shared copy mapped. The mappings go with the last view, when the write returns.
"""

from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from rlpipe.weightsync.errors import SyncError
from rlpipe.orphans import remove_orphans
from rlpipe.weightsync.ownership import SHM_DIR, check_own_file
from rlpipe.weightsync.transport import _SEGMENT_PREFIX
_ALIGN = 64  # every tensor starts on a cache line
MESSAGE_KEY = "rlpipe_shared_weights"


@dataclass(frozen=True)
class SharedTensor:
    """Where one tensor of a version lies in shared memory."""

    name: str
    path: str
    offset: int
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class SharedWeights:
    """A version as the workers of one engine receive it: where each tensor lies, and how much of it a worker maps
    at a time. Pickles to a few bytes per tensor."""

    tensors: tuple[SharedTensor, ...]
    chunk_bytes: int

    def message(self) -> dict:
        """As vLLM's RPC carries it (msgpack: plain dicts, lists, strings and numbers)."""
        return {MESSAGE_KEY: [[t.name, t.path, t.offset, t.dtype, list(t.shape)] for t in self.tensors],
                "chunk_bytes": self.chunk_bytes}

    @classmethod
    def from_message(cls, message: dict) -> SharedWeights:
        tensors = tuple(SharedTensor(name, path, int(offset), dtype, tuple(int(s) for s in shape))
                        for name, path, offset, dtype, shape in message[MESSAGE_KEY])
        return cls(tensors, int(message["chunk_bytes"]))

    @staticmethod
    def is_message(payload) -> bool:
        return isinstance(payload, dict) and MESSAGE_KEY in payload

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class HostCopy:
    """The engine's side: publishes a version for its workers (see the module's docstring)."""

    def __init__(self, chunk_bytes: int = 64 * 2**20, directory: str = SHM_DIR):
        self.chunk_bytes, self.directory = max(1, int(chunk_bytes)), directory
        self._cleaned = False
        self._staging: dict[str, tuple[int, int]] = {}  # staging segments alive: path -> (address, size)
        self.bytes_copied = 0  # by the last publish: what did not already lie in shared memory
        self.bytes_referenced = 0  # by the last publish: what the workers read where it was

    def segment_prefix(self) -> str:
        """The start of the names of this process's segments."""
        return f"{_SEGMENT_PREFIX}{os.getpid()}-host-"

    @contextlib.contextmanager
    def marker(self) -> Iterator[tuple[str, int, int]]:
        """A small file of this engine's in the shared-memory directory, as (path, device, inode), for the duration
        of the context: a worker that finds the same file there (`sees_file`) reads the host copy."""
        path = os.path.join(self.directory, f"{self.segment_prefix()}{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            stat = os.fstat(fd)
            yield path, stat.st_dev, stat.st_ino
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _remove_orphans(self) -> None:
        if not self._cleaned:
            remove_orphans(self.directory, _SEGMENT_PREFIX, os.unlink)  # as the `shm` sender's sweep does
            self._cleaned = True

    def staging_memory(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Memory for staging a version straight into shared memory: one segment of this engine's laid out for
        `shapes`, as a tensor per name viewing it. `publish` finds them there and copies nothing. The segment lives
        while any of the tensors does (its file is unlinked when the last goes, at `close`, at interpreter exit, or,
        after a crash, by the next engine's or `shm` sender's orphan cleanup: its name carries this process's id)."""
        self._remove_orphans()
        offsets, size = {}, 0
        for name, shape in shapes.items():
            offsets[name] = size
            size += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        path = os.path.join(self.directory, f"{self.segment_prefix()}stage-{uuid.uuid4().hex[:12]}")
        mapped = self._create_segment(path, size, "the engine's staging")
        base = np.frombuffer(mapped, dtype=np.uint8)
        address = base.ctypes.data
        self._staging[path] = (address, max(1, size))
        # When the last view goes (numpy's slices and torch's tensors keep `base` alive), the file goes with it.
        weakref.finalize(base, _drop_segment, self._staging, path, mapped)
        tensors = {}
        for name, shape in shapes.items():
            nbytes = math.prod(shape) * dtype.itemsize
            raw = torch.from_numpy(base[offsets[name] : offsets[name] + nbytes])
            tensors[name] = raw.view(dtype).view(tuple(shape))
        return tensors

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lies in one of this engine's staging segments (`staging_memory`)."""
        return tensor.device.type == "cpu" and tensor.is_contiguous() and self._in_staging(tensor) is not None

    def _in_staging(self, tensor: torch.Tensor) -> tuple[str, int] | None:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        for path, (address, nbytes) in list(self._staging.items()):
            if address <= start and end <= address + nbytes:
                return path, start - address
        return None

    def close(self) -> None:
        """Unlink the staging segments' files (their memory goes with the last view of them)."""
        for path in list(self._staging):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._staging.clear()

    @contextlib.contextmanager
    def publish(self, weights: dict[str, torch.Tensor]) -> Iterator[SharedWeights]:
        """`weights` in shared memory for the duration of the context; the segment this made is gone after it."""
        self._remove_orphans()
        placed: dict[str, SharedTensor] = {}
        to_copy: list[tuple[str, torch.Tensor, int]] = []
        size = 0
        for name, tensor in weights.items():
            tensor = tensor.detach()
            dtype = str(tensor.dtype).removeprefix("torch.")
            where = None
            if tensor.is_contiguous() and tensor.device.type == "cpu":
                where = self._in_staging(tensor)
            if where is not None:
                placed[name] = SharedTensor(name, where[0], where[1], dtype, tuple(tensor.shape))
            else:
                to_copy.append((name, tensor, size))
                size += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        path = os.path.join(self.directory, f"{self.segment_prefix()}{uuid.uuid4().hex[:12]}")
        try:
            if to_copy:
                self._write_segment(path, size, to_copy)
                for name, tensor, offset in to_copy:
                    dtype = str(tensor.dtype).removeprefix("torch.")
                    placed[name] = SharedTensor(name, path, offset, dtype, tuple(tensor.shape))
            self.bytes_copied = sum(t.numel() * t.element_size() for _, t, _ in to_copy)
            self.bytes_referenced = sum(placed[n].nbytes for n in placed) - self.bytes_copied
            yield SharedWeights(tuple(placed[name] for name in weights), self.chunk_bytes)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _create_segment(self, path: str, size: int, what: str) -> mmap.mmap:
        """A new file `path` of `size` bytes, its memory claimed, mapped shared and writable; unlinked if this fails."""
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:  # the memory is claimed now: a full /dev/shm fails here, not with a SIGBUS mid-copy
                os.posix_fallocate(fd, 0, max(1, size))
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    raise SyncError(
                        f"weight sync: no room in {self.directory} for {what} ({size} bytes), "
                        "one copy of the weights in the rollout dtype"
                    ) from err
                os.ftruncate(fd, max(1, size))
            return mmap.mmap(fd, max(1, size), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)

    def _write_segment(self, path: str, size: int, tensors: list[tuple[str, torch.Tensor, int]]) -> None:
        mapped = self._create_segment(path, size, "the engine's host copy")
        try:
            _copy_into(mapped, tensors)
        finally:
            with contextlib.suppress(BufferError):  # a view kept alive by a traceback: unmapped when it goes
                mapped.close()


def _drop_segment(segments: dict[str, tuple[int, int]], path: str, mapped: mmap.mmap) -> None:
    segments.pop(path, None)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    with contextlib.suppress(BufferError, ValueError):
        mapped.close()


def _copy_into(mapped: mmap.mmap, tensors: list[tuple[str, torch.Tensor, int]]) -> None:
    whole = torch.frombuffer(mapped, dtype=torch.uint8)
    for _, tensor, offset in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        whole[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)


def sees_file(path: str, device: int, inode: int) -> bool:
    """Whether this process finds the very file `path` that the engine made (`HostCopy.marker`): the same host and
    the same shared-memory directory, not a namesake in another container or on another host."""
    try:
        stat = os.stat(path)
    except OSError:
        return False
    return (stat.st_dev, stat.st_ino) == (device, inode)


class _Mapping:
    """One file mapped privately in a worker, and the pages read from it not yet dropped."""

    def __init__(self, path: str):
        with open(path, "rb") as file:
            info = os.fstat(file.fileno())
            check_own_file(info, path)  # the engine's own file, which nobody else can have changed
            size = info.st_size
            # MAP_PRIVATE, writable: reads share the file's pages; a write would go to a private page, never to them.
            self.map = mmap.mmap(file.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.bytes = np.frombuffer(self.map, dtype=np.uint8)
        self.read: list[tuple[int, int]] = []

    def drop_read_pages(self) -> None:
        """Unmap the pages of the spans read so far from this process (a later touch maps them again)."""
        page = mmap.PAGESIZE
        for start, end in self.read:
            first, last = -(-start // page) * page, end // page * page
            if last > first:
                with contextlib.suppress(OSError, ValueError):
                    self.map.madvise(mmap.MADV_DONTNEED, first, last - first)
        self.read.clear()


@contextlib.contextmanager
def read_shared_weights(shared: SharedWeights) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """The worker's side: (name, tensor) pairs read from the shared copy, one at a time, for the worker's loaders
    to copy from. Every `shared.chunk_bytes` handed out, the pages read so far are dropped from this process. The
    tensors are views of the shared copy: valid inside the context (and as long as they are referenced)."""
    mappings: dict[str, _Mapping] = {}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        pending = 0
        for item in shared.tensors:
            mapping = mappings.get(item.path)
            if mapping is None:
                try:
                    mapping = mappings[item.path] = _Mapping(item.path)
                except FileNotFoundError as err:
                    raise SyncError(f"weight sync: the shared copy {item.path} is gone (the engine's "
                                    "workers must run on its host)") from err
            dtype, nbytes = getattr(torch, item.dtype), item.nbytes
            # The file's size now, not when it was mapped: a page past the end of a truncated file is SIGBUS.
            if item.offset + nbytes > min(mapping.bytes.nbytes, os.stat(item.path).st_size):
                raise SyncError(f"weight sync: {item.name} lies past the end of {item.path}")
            if pending >= shared.chunk_bytes:
                for each in mappings.values():
                    each.drop_read_pages()
                pending = 0
            raw = torch.from_numpy(mapping.bytes[item.offset : item.offset + nbytes])
            yield item.name, raw.view(dtype).view(item.shape)
            mapping.read.append((item.offset, item.offset + nbytes))
            pending += nbytes

    try:
        yield tensors()
    finally:
        for mapping in mappings.values():
            mapping.drop_read_pages()
        mappings.clear()  # each file is unmapped once no view of it is left
