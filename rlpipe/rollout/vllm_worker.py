"""The vLLM side of a weight write: the worker extension rlpipe mixes into every vLLM worker of an engine. Workers in
child processes on the engine's host read a version from one shared host copy (`SharedWeights`,
rlpipe/weightsync/hostcopy.py); workers that do not share its /dev/shm (vLLM's Ray executor may place them on other
hosts) get it as bytes. Runs inside vLLM's workers."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

from rlpipe.weightsync import SyncError
from rlpipe.weightsync.hostcopy import SharedWeights, read_shared_weights, sees_file


def encode_weights(tensors: dict[str, torch.Tensor]) -> bytes:
    """Weights as safetensors bytes: they cross process boundaries (Ray, vLLM's RPC) without pickle."""
    return save_safetensors_bytes({name: t.detach().contiguous() for name, t in tensors.items()})


def decode_weights(payload: bytes) -> dict[str, torch.Tensor]:
    return load_safetensors_bytes(payload)


def count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """How many of each row of `x` are at least that row's value in `values` ([rows, 1]): vLLM's
    `batched_count_greater_than`, eagerly."""
    return (x >= values).sum(-1)


class WeightWriter:
    """vLLM's worker extension: mixed into every vLLM worker of an engine and reached through `collective_rpc`, it
    writes a version of the weights into the worker's model."""

    def rlpipe_load_weights(
        self, weights: dict | bytes | list[tuple[str, torch.Tensor]], in_place: bool = False
    ) -> int:
        """Apply a complete set of weights: where each lies in the engine's shared host copy (workers on its host;
        `SharedWeights.message()`), safetensors bytes (workers elsewhere) or the tensors themselves (an in-process
        engine). `in_place` (sync.engine_write) writes into the tensors the engine computes with, where its layers
        allow (`_writes_in_place`); otherwise vLLM's in-place reload builds each layer anew. Then what the model
        holds is compared with what it was given (`_check_written`)."""
        if SharedWeights.is_message(weights):
            weights = SharedWeights.from_message(weights)
            # Read tensor by tensor from the one copy every worker of the engine maps, each copied into this
            # worker's own tensors by its loaders; no copy of the version of this worker's own.
            with read_shared_weights(weights) as tensors:
                written = self._rlpipe_apply(tensors, weights.names, in_place)
            with read_shared_weights(weights) as tensors:
                self._check_written(tensors)
            return written
        if isinstance(weights, bytes):
            weights = list(decode_weights(weights).items())
        written = self._rlpipe_apply(iter(weights), [name for name, _ in weights], in_place)
        self._check_written(iter(weights))
        return written

    def _check_written(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Compare every tensor of the version with where the model now holds it, whatever tokens the probe sees:
        raises a `SyncError` naming the first that differs. A tensor is found under its own name, or as its rows
        of the parameter vLLM fuses it into (q/k/v into qkv_proj, gate/up into gate_up_proj, in that order);
        embedding rows past the version's (vocabulary padding) are not compared. Skipped where the engine does not
        hold the tensor as it was given: tensor-parallel slices, layers whose plain weight vLLM dropped after
        packing it (a reload on CPU), other dtypes or shapes, stacked experts, TPU engines (transposed)."""
        from vllm.distributed import get_tensor_model_parallel_world_size

        if vllm_platform() == "torchtpu" or get_tensor_model_parallel_world_size() != 1:
            return
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        fused = {part: (whole, parts) for whole, parts in getattr(model, "packed_modules_mapping", {}).items()
                 for part in parts}
        given = list(weights)
        rows = {name: tensor.shape[0] if tensor.dim() else 1 for name, tensor in given}
        for name, tensor in given:
            held, start = _held_rows(name, tensor, params, fused, rows)
            if held is None:
                continue
            if not _equal_bytes(held, tensor):
                raise SyncError(f"after the write the engine's model does not hold {name} as it was given "
                                f"(rows {start}-{start + rows[name]} of its parameter differ); the write went wrong")

    def _rlpipe_apply(self, weights: Iterator[tuple[str, torch.Tensor]], names: list[str], in_place: bool) -> int:
        if vllm_platform() == "torchtpu":
            return self._reload_on_torchtpu(weights)
        if in_place and self._writes_in_place():
            self._write_in_place(weights)
            return len(names)
        # In-place reload keeps vLLM's own loaders in charge of fusing (qkv, gate/up), tensor-parallel slicing
        # and CPU repacking.
        try:
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        except Exception:
            self._abandon_partial_reload()
            raise
        self._refresh_tied_output_layer()
        self._prepack_reloaded_experts(set(names))
        return len(names)

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

    def _write_in_place(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
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

    def rlpipe_write_adapters(
        self, adapters: bytes | list[tuple[str, torch.Tensor]], lora_id: int, scaling: float
    ) -> bool:
        """Write a version of the LoRA adapters (under their PEFT names, without the `base_model.model.` prefix) into
        the LoRA buffers of the slot that serves adapter `lora_id`, as vLLM's own load of an adapter folder fills them
        (`LoRAModelManager.activate_adapter`): B scaled by `scaling` in the LoRA dtype, q/k/v and gate/up packed into
        their fused layer's slices, each layer's `set_lora` padding the rank and slicing for tensor parallelism. The
        adapter vLLM keeps registered under `lora_id` gets the same tensors, so that re-activating it serves this
        version. Then every written slot is read back against what was given (`_check_adapters`).

        Returns False, writing nothing, where the slot does not hold an adapter of this shape to overwrite: nothing
        loaded under `lora_id` yet (a new engine), a module the adapters and the loaded one do not share, a layer
        other than a plain linear one. The caller then loads the adapters through vLLM (an adapter folder)."""
        if isinstance(adapters, bytes):
            adapters = decode_weights(adapters)
        given = dict(adapters)
        manager = getattr(getattr(self.model_runner, "lora_manager", None), "_adapter_manager", None)
        if manager is None or lora_id not in manager.lora_index_to_id:
            return False
        registered = manager.get_adapter(lora_id)
        writes = _adapter_writes(manager, registered, given, scaling) if registered is not None else None
        if writes is None:
            return False
        slot = manager.lora_index_to_id.index(lora_id)
        for module, held, lora_a, lora_b in writes:
            module.set_lora(slot, lora_a, lora_b)
            held.lora_a, held.lora_b = lora_a, lora_b
        _check_adapters(writes, slot)
        return True

    def rlpipe_sees_file(self, path: str, device: int, inode: int) -> bool:
        """Whether this worker shares the engine's shared-memory directory, and so can read its host copy."""
        return sees_file(path, device, inode)

    def rlpipe_count_ranks_eagerly(self) -> None:
        """On CPU, count each token's rank among the vocabulary eagerly instead of through vLLM's torch.compile'd
        count: compiling it with inductor is ~3 s of the first request with log-probs (the start-up sync's probe) in
        every engine process, and the count is one comparison and a sum. rlpipe never reads the ranks."""
        from vllm.platforms import current_platform
        from vllm.v1.sample import sampler

        if current_platform.is_cpu():
            sampler.batched_count_greater_than = count_greater_than

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

    def _reload_on_torchtpu(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
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
        given = [0]

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for item in weights:
                given[0] += 1
                yield item

        self.model_runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        _wait_for_chip(model)
        return given[0]

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


def _equal_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes: libc's memcmp for contiguous host tensors
    (2-2.5x torch.equal's speed on a model's worth of weights), torch.equal otherwise. Tensors on two devices (a
    GPU engine's parameter, the host tensor it was written from) are compared on the host, one tensor's copy at a
    time: torch.equal refuses mixed devices, and a copy onto the GPU could take memory vLLM claimed."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    if a.device.type != "cpu" or b.device.type != "cpu" or not (a.is_contiguous() and b.is_contiguous()):
        return torch.equal(a, b)
    return _memcmp()(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0


@functools.cache
def _memcmp():
    import ctypes

    memcmp = ctypes.CDLL(None).memcmp
    memcmp.restype, memcmp.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


def _held_rows(name: str, tensor: torch.Tensor, params: dict[str, torch.Tensor], fused: dict[str, tuple[str, list[str]]],
               rows: dict[str, int]) -> tuple[torch.Tensor | None, int]:
    """Where the model holds the version's tensor `name` as it was given, and at which row of its parameter; None
    where it does not hold it that way (see `WeightWriter._check_written`)."""
    module, start = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else "", 0
    param = params.get(name)
    if param is None and module in fused:
        whole, parts = fused[module]
        siblings = [name.replace(f".{module}.", f".{part}.") for part in parts]
        if not all(sibling in rows for sibling in siblings):
            return None, 0
        param = params.get(name.replace(f".{module}.", f".{whole}."))
        start = sum(rows[sibling] for sibling in siblings[: parts.index(module)])
    if param is None or param.dtype != tensor.dtype or param.numel() == 0:
        return None, 0
    if tensor.dim() == 0 or param.dim() != tensor.dim() or param.shape[1:] != tensor.shape[1:]:
        return (param, 0) if param.shape == tensor.shape else (None, 0)
    if param.shape[0] < start + tensor.shape[0]:
        return None, 0
    return param.data[start : start + tensor.shape[0]], start


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


def _wait_for_chip(model) -> None:
    """Wait until the chip has done every copy of a write: the host tensors it copies from (views of the shared copy,
    or decoded bytes) are released as soon as the write returns. On torch >= 2.11 `torch.tpu.synchronize` raises when
    called from outside torch and torch_tpu, naming `torch.accelerator.synchronize` (which vllm-torchtpu's platform
    calls too) instead."""
    device = next((param.device for param in model.parameters() if param.device.type != "cpu"), None)
    if device is not None:  # a model on the CPU has nothing in flight
        torch.accelerator.synchronize(device)


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


def _adapter_writes(manager, registered, given: dict[str, torch.Tensor], scaling: float) -> list | None:
    """What `WeightWriter.rlpipe_write_adapters` writes: for every LoRA layer of `manager` (vLLM's
    `LoRAModelManager`) that the adapter `registered` (its `LoRAModel`) holds weights for, the layer, those weights
    and the new A and B, prepared as vLLM prepares a loaded adapter (`LoRAModel.from_lora_tensors`, then
    `PackedLoRALayerWeights.pack` and `optimize`): cast to the LoRA dtype, B multiplied by the scaling in that dtype,
    a fused layer's parts as lists in its packing order. None where `given` does not fit the loaded adapter module
    for module (see there)."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.classifier import ClassificationHeadWithLoRA

    dtype = manager.lora_config.lora_dtype
    writes, used = [], set()
    for module_name, module in manager.modules.items():
        held = manager._get_lora_layer_weights(registered, module_name)
        parts = manager.packed_modules.get(module_name, [module_name])
        names = [(f"{part}.lora_A.weight", f"{part}.lora_B.weight") for part in parts]
        pairs = [(given.get(name_a), given.get(name_b)) for name_a, name_b in names]
        if held is None:
            if any(a is not None or b is not None for a, b in pairs):
                return None
            continue
        plain = isinstance(module, BaseLinearLayerWithLoRA) and not isinstance(module, ClassificationHeadWithLoRA)
        packed = module_name in manager.packed_modules
        held_a, held_b = _as_lists(held)
        if not plain or packed != held.is_packed or len(held_a) != len(pairs):
            return None
        if packed and len(pairs) != module.n_slices:
            return None
        lora_a, lora_b = [], []
        for (a, b), was_a, was_b in zip(pairs, held_a, held_b):
            if a is None and b is None and was_a is None:  # a part of a fused layer that has no adapter
                lora_a.append(None)
                lora_b.append(None)
                continue
            if a is None or b is None or was_a is None or a.shape != was_a.shape or b.shape != was_b.shape:
                return None
            lora_a.append(a.to(dtype=dtype, copy=True))
            lora_b.append(b.to(dtype=dtype, copy=True))
            if scaling != 1:  # LoRALayerWeights.optimize
                lora_b[-1] *= scaling
        used.update(name for pair, (a, _) in zip(names, pairs) if a is not None for name in pair)
        writes.append((module, held, lora_a if packed else lora_a[0], lora_b if packed else lora_b[0]))
    return writes if used == set(given) else None


def _as_lists(held) -> tuple[list, list]:
    """A vLLM LoRA layer's A and B as lists of slices (a fused layer's are lists already)."""
    if held.is_packed:
        return held.lora_a, held.lora_b
    return [held.lora_a], [held.lora_b]


def _check_adapters(writes: list, slot: int) -> None:
    """Read back slot `slot` of every LoRA layer `writes` wrote: each slice's A and B must be what `set_lora` was given
    (after the layer's own tensor-parallel slicing) and the rest of the slot, the rank's padding, zero. Raises a
    `SyncError` naming the first layer that differs."""
    for module, _, lora_a, lora_b in writes:
        if module.tp_size > 1:
            lora_a, lora_b = module.slice_lora_a(lora_a), module.slice_lora_b(lora_b)
        if isinstance(lora_a, torch.Tensor):
            lora_a, lora_b = [lora_a], [lora_b]
        for stacked, given in ((module.lora_a_stacked, lora_a), (module.lora_b_stacked, lora_b)):
            for index, tensor in enumerate(given):
                held = stacked[index][slot, 0]
                rows, cols = tensor.shape if tensor is not None else (0, 0)  # a part without an adapter: zero
                same = tensor is None or _equal_bytes(held[:rows, :cols], tensor)
                if not (same and not held[rows:].any() and not held[:, cols:].any()):
                    raise SyncError(f"after the write the LoRA buffers of {getattr(module.base_layer, 'prefix', '')} "
                                    f"do not hold the adapter as it was given; the write went wrong")
