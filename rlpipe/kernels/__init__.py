"""Kernels shared by the learner and the rollout side, one module per op: a torch reference, a Pallas kernel
(interpreted off TPU) and the torch.library bridge to it. `model.kernels.*` chooses the implementation per op."""

from rlpipe.kernels._jax import register_torchtpu_ops
from rlpipe.kernels.attention import causal_attention, document_attention, reference_attention
from rlpipe.kernels.gmm import grouped_matmul, reference_grouped_matmul
from rlpipe.kernels.logprob import linear_logprob, logits_logprob, reference_linear_logprob
from rlpipe.kernels.rmsnorm import reference_rms_norm, rms_norm

__all__ = [
    "causal_attention",
    "document_attention",
    "grouped_matmul",
    "linear_logprob",
    "logits_logprob",
    "reference_attention",
    "reference_grouped_matmul",
    "reference_linear_logprob",
    "reference_rms_norm",
    "register_torchtpu_ops",
    "rms_norm",
]
