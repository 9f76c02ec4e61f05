"""The weight-sync channel: learner shards -> buckets -> transport -> engine staging -> verified reload."""

from rlpipe.weightsync.codec import Staging, SyncError, checksum, pack_part
from rlpipe.weightsync.probe import DECODE_TOKENS, DecodedProbe, decoded_gaps
from rlpipe.weightsync.plan import (
    Bucket,
    Destination,
    EngineLayout,
    Piece,
    SyncPlan,
    engine_tensors,
    plan_sync,
    shard_rows,
)
from rlpipe.weightsync.routes import SyncRoutes, plan_routes
from rlpipe.weightsync.sender import OutgoingPart, stream_parts
from rlpipe.weightsync.transport import TRANSPORTS, make_transport

__all__ = [
    "DECODE_TOKENS",
    "Bucket",
    "DecodedProbe",
    "Destination",
    "EngineLayout",
    "OutgoingPart",
    "Piece",
    "Staging",
    "SyncError",
    "SyncPlan",
    "SyncRoutes",
    "TRANSPORTS",
    "checksum",
    "decoded_gaps",
    "engine_tensors",
    "make_transport",
    "pack_part",
    "plan_routes",
    "plan_sync",
    "shard_rows",
    "stream_parts",
]
