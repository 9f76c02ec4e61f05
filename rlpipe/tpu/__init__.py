"""What a TPU recipe does before and during its first step that needs no chip, rehearsed on a host without one
(`rlpipe rehearse`): the learner's step compiled by TorchTPU on fake `tpu` tensors (`step`), and the checks a start
runs, in its order (`rehearse`). Everything here needs the `tpu` extra (torch-tpu, vllm-torchtpu, jax)."""
