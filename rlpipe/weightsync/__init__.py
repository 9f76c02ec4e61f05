"""The weight-sync channel: learner shards -> buckets -> transport -> engine staging -> verified write.

The learner's end packs and sends (sender.py), an engine's end receives, checks and commits (receiver.py), both
through one `Transport` (transport.py); the plan (layout.py) and the routes (routes.py) are computed once per run.
"""

from rlpipe.weightsync.codec import checksum, pack_part
from rlpipe.weightsync.errors import NonFiniteWeights, SyncError
from rlpipe.weightsync.probe import DECODE_TOKENS, DecodedProbe, decoded_gaps, probe_gaps
from rlpipe.weightsync.layout import (
    Bucket,
    Destination,
    EngineLayout,
    Piece,
    SyncPlan,
    plan_sync,
    shard_rows,
)
from rlpipe.weightsync.receiver import WeightReceiver
from rlpipe.weightsync.routes import SyncRoutes, plan_routes
from rlpipe.weightsync.sender import OutgoingPart, stream_parts
from rlpipe.weightsync.staging import Staging
from rlpipe.weightsync.transport import TRANSPORTS, Transport, make_transport

__all__ = [
    "DECODE_TOKENS",
    "Bucket",
    "DecodedProbe",
    "Destination",
    "EngineLayout",
    "OutgoingPart",
    "NonFiniteWeights",
    "Piece",
    "Staging",
    "SyncError",
    "SyncPlan",
    "SyncRoutes",
    "TRANSPORTS",
    "Transport",
    "WeightReceiver",
    "checksum",
    "decoded_gaps",
    "make_transport",
    "pack_part",
    "plan_routes",
    "plan_sync",
    "probe_gaps",
    "shard_rows",
    "stream_parts",
]
