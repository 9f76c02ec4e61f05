"""Which transport each learner-rank/engine pair uses, from the hosts Ray placed them on.

`sync.transport: auto` sends through shared memory where a learner rank and an engine share a host and through
the Ray object store where they do not; `shm`, `ray` and `gloo` use one transport for every pair, and `shm`
refuses a pair on two hosts before anything is sent (its segments exist only on the host that made them).

A host is a node address: Ray nodes started on one machine with one address (a local multi-node cluster) share
its /dev/shm; nodes on different addresses are treated as different machines even when they are not (network
namespaces, containers), which is the safe side: the object store works everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlpipe.config import ConfigError


@dataclass(frozen=True)
class SyncRoutes:
    """`pairs[rank][engine]`: the transport from learner rank `rank` to engine `engine` ("shm" or "ray" under
    auto; the configured transport otherwise). `whole_buckets`: every pair uses shared memory, so all ranks write
    into one segment per bucket (see transport.py); otherwise each rank sends its own part. `shared_host`: some
    learner rank runs on the host of some engine, whatever the transport, so they compete for its cores."""

    transport: str
    pairs: tuple[tuple[str, ...], ...]
    shared_host: bool = False

    @property
    def whole_buckets(self) -> bool:
        return all(kind == "shm" for row in self.pairs for kind in row)

    def to_engines(self, rank: int) -> list[str]:
        return list(self.pairs[rank])

    def from_ranks(self, engine: int) -> list[str]:
        return [row[engine] for row in self.pairs]

    def counts(self) -> dict[str, float]:
        """`sync/pairs_shm`, `sync/pairs_ray`: how many learner-rank/engine pairs use each (auto, shm and ray)."""
        kinds = [kind for row in self.pairs for kind in row]
        return {f"sync/pairs_{kind}": float(kinds.count(kind)) for kind in ("shm", "ray")}

    def in_words(self) -> str:
        """The transport for a run's start-up line: "shared memory", or under auto how many pairs take each route."""
        names = {"shm": "shared memory", "ray": "object store", "gloo": "gloo"}
        if self.transport != "auto":
            return names[self.transport]
        kinds = [kind for row in self.pairs for kind in row]
        used = sorted(set(kinds), key=kinds.index)
        if len(used) == 1:
            return f"auto: {names[used[0]]}"
        return "auto: " + ", ".join(
            f"{names[kind]} for {kinds.count(kind)} pair{'s' if kinds.count(kind) > 1 else ''}" for kind in used
        )

    def describe(self) -> dict[str, str]:
        """For summary.json: "learner 0 -> engine 1": "shm", ..."""
        return {
            f"learner {rank} -> engine {engine}": kind
            for rank, row in enumerate(self.pairs)
            for engine, kind in enumerate(row)
        }


def plan_routes(transport: str, learner_hosts: list[str], engine_hosts: list[str]) -> SyncRoutes:
    """The routes for learner ranks and engines on these hosts (node addresses, in rank and engine order).
    Raises ConfigError when `shm` is asked for between two hosts."""
    if transport == "shm":
        for rank, learner_host in enumerate(learner_hosts):
            for engine, engine_host in enumerate(engine_hosts):
                if learner_host != engine_host:
                    raise ConfigError(
                        f"sync.transport: shm needs every learner rank and engine on one host, but learner rank "
                        f"{rank} is on {learner_host} and rollout engine {engine} on {engine_host} "
                        f"(use auto or ray across hosts)"
                    )
    if transport == "auto":
        pairs = tuple(tuple("shm" if a == b else "ray" for b in engine_hosts) for a in learner_hosts)
    else:
        pairs = tuple(tuple(transport for _ in engine_hosts) for _ in learner_hosts)
    return SyncRoutes(transport, pairs, shared_host=bool(set(learner_hosts) & set(engine_hosts)))
