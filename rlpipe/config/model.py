"""The `model` section: the model folder, its tokenizer, the learner's dtype, and the kernels both sides run."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from rlpipe.config.errors import require
from rlpipe.config.keys import key


@dataclass
class KernelsConfig:
    logprob: Literal["chunked", "reference", "pallas"] = key(
        "chunked",
        "log-probs through the output projection: chunked (over the vocabulary; never [tokens x vocab] logits), "
        "reference (whole logits), pallas (the Pallas kernel; interpreted off TPU, slow)",
    )
    logprob_chunk: int = key(8192, "vocabulary entries per chunk of the chunked log-prob path")
    rmsnorm: Literal["torch", "pallas"] = key("torch", "RMSNorm: torch ops, or the Pallas kernel (interpreted off TPU)")
    attention: Literal["torch", "pallas"] = key(
        "torch",
        "causal GQA attention: torch's scaled_dot_product_attention (on a packed row under a [W, W] mask), or "
        "pallas: JAX's splash kernel (torch.tpu.ops.splash_sdpa on TorchTPU; packed rows by segment ids, no shared "
        "prompts; interpreted off TPU)",
    )
    experts: Literal["auto", "torch", "pallas", "loop"] = key(
        "auto",
        "mixture-of-experts layers: tokens sorted by expert, one grouped matmul per projection with the torch "
        "reference or the Pallas kernel (TorchTPU's ragged_dot on tpu, interpreted megablox elsewhere); loop: one "
        "slice per expert (transformers' way, eager only); auto: pallas in a program compiled for TorchTPU, torch "
        "elsewhere",
    )

    def check(self) -> None:
        require(self.logprob_chunk >= 1, "model.kernels.logprob_chunk: must be >= 1")

    def decided(self, compiled_for_tpu: bool) -> KernelsConfig:
        """These kernels as a program runs them, `experts: auto` decided: pallas where the program is compiled for
        TorchTPU (`compiled_for_tpu`), which cannot run the torch reference (it splits rows by group sizes read on
        the host), torch elsewhere."""
        if self.experts != "auto":
            return self
        return replace(self, experts="pallas" if compiled_for_tpu else "torch")


@dataclass
class ModelConfig:
    path: str = key(
        "builtin:smollm2-135m-instruct",
        "Hugging Face folder (config.json + safetensors + tokenizer), a Hub id org/name[@revision] (downloaded into "
        "the Hugging Face cache before the run starts), or builtin:smollm2-135m-instruct",
    )
    tokenizer: str | None = key(None, "tokenizer folder when it is not inside model.path")
    dtype: Literal["float32", "bfloat16"] = key("float32", "learner parameter and compute dtype")
    impl: Literal["auto", "rlpipe", "transformers"] = key(
        "auto",
        "the learner's model code: rlpipe's decoder (llama, mistral, qwen2, qwen3, qwen3_moe: SimpleFSDP, the captured "
        "step, the Pallas kernels), transformers' AutoModelForCausalLM (any decoder-only text family it knows; eager "
        "steps, torch kernels), or auto: rlpipe's where it has the family, else transformers' (docs/models.md)",
    )
    kernels: KernelsConfig = field(default_factory=KernelsConfig)

    def check(self) -> None:
        self.kernels.check()
