"""The weight sync's error types."""


class SyncError(RuntimeError):
    """A weight update that must not be applied (or was rolled back); the message says which check failed."""


class NonFiniteWeights(RuntimeError):
    """The learner's weights hold NaN or inf: the training step that produced them diverged. Not a transfer fault,
    so a sync that raises it is not worth repeating; the message names the tensor."""
