"""The plan's figures: a `MemoryItem` (one labelled size), a `Peak` (a moment's parts against what they must fit in), a
`SidePlan` (one role's parts per chip against its chips' HBM), and the bytes of each dtype. Every other module of the
plan builds these; this one imports nothing of the plan."""

from __future__ import annotations

from dataclasses import dataclass

from rlpipe.hardware.device import TpuSlice
from rlpipe.hardware.tpu_layout import SliceShare

GIB = 2**30
USABLE_FRACTION = 0.9

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _keyed(items, key: str):
    """The item of `items` (parts, peaks) whose `key` is `key`."""
    for item in items:
        if item.key == key:
            return item
    raise KeyError(key)


@dataclass(frozen=True)
class MemoryItem:
    key: str  # stable name for tests: "parameters", "kv_cache", ...
    label: str  # what the table prints
    bytes: float

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class Peak:
    """A moment's memory, outside the steady step, against what it must fit in: the learner's load per chip
    (`learner_load`), a learner host's RAM (`learner_host`, the largest of its phases), an engine host's RAM at a
    sync (`rollout_host`), and each host's /dev/shm (`learner_shm`, `rollout_shm`)."""

    key: str
    name: str  # what the NOT OK line and the notes call it
    title: str  # what the table prints above the parts
    parts: tuple[MemoryItem, ...]
    limit_bytes: float | None  # what it must fit in; None: nothing to compare against (`missing` says why)
    limit_label: str = ""
    missing: str = ""
    largest_part: bool = False  # the parts are phases that do not overlap: the peak is the largest, not the sum

    @property
    def total_bytes(self) -> float:
        sizes = [part.bytes for part in self.parts]
        return max(sizes, default=0) if self.largest_part else sum(sizes)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def fits(self) -> bool | None:
        return None if self.limit_bytes is None else self.total_bytes <= self.limit_bytes

    @property
    def over_gib(self) -> float:
        return (self.total_bytes - (self.limit_bytes or 0)) / GIB

    def part(self, key: str) -> MemoryItem:
        return _keyed(self.parts, key)


@dataclass(frozen=True)
class SidePlan:
    role: str  # "learner" | "rollout"
    summary: str
    parts: tuple[MemoryItem, ...]
    share: SliceShare | None  # the chips of a TPU slice this side runs on
    usable_fraction: float = USABLE_FRACTION

    @property
    def slice(self) -> TpuSlice | None:
        return None if self.share is None else self.share.tslice

    @property
    def total_bytes(self) -> float:
        return sum(part.bytes for part in self.parts)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def usable_bytes(self) -> float | None:
        return None if self.slice is None else self.usable_fraction * self.slice.hbm_bytes

    @property
    def fits(self) -> bool | None:
        """None when no TPU slice is configured for this role."""
        return None if self.slice is None else self.total_bytes <= self.usable_bytes

    def part(self, key: str) -> MemoryItem:
        return _keyed(self.parts, key)

