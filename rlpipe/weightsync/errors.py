"""The weight sync's one error type."""


class SyncError(RuntimeError):
    """A weight update that must not be applied (or was rolled back); the message says which check failed."""
