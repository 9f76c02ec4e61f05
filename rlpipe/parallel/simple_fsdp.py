"""SimpleFSDP: fully sharded data parallelism written as ordinary tensor ops.

Every parameter is stored as a DTensor sharded on dim 0 over the mesh's "shard" dimension (and replicated over a
"replicate" dimension for hybrid sharding). Reading a parameter attribute (`linear.weight`) all-gathers it into a
plain tensor in the compute dtype; the gathered tensor's gradient is declared a partial sum, so autograd turns it
into a reduce-scatter (plus an all-reduce over replicas) in the reduce dtype and accumulates the result, cast back
to the master dtype, into the sharded parameter's `.grad`. Because the collectives are plain differentiable ops,
torch.compile captures forward, backward and the collectives in one graph and can schedule them freely.

How the attribute read is redirected: each module that owns parameters gets its `__class__` swapped for a cached
subclass in which those parameter names are properties. `nn.utils.parametrize` would do the gathering too, but it
moves parameters to `parametrizations.<name>.original` and so renames every state-dict key; the class swap keeps
`state_dict()` and `named_parameters()` under the unsharded (Hugging Face) names, yielding the local shards.

Consequences worth knowing:
- Reading a parameter attribute outside forward (`model.lm_head.weight`, `model.output_embedding()`, a hook,
  `print` of a module whose repr reads weights) is a collective: every rank must do it, in the same order.
- In-place writes through the attribute land in a temporary gathered copy and are lost. Initialise or edit
  weights under `gathering_disabled()` (the attribute then is the sharded DTensor parameter itself).
- A weight used twice per step (tied embeddings read for the input lookup and the output projection) is gathered
  twice; the two gradients are reduce-scattered separately and summed into the one sharded `.grad`.

Mixture-of-experts weights (rlpipe/models/moe.py) are stacked per layer, [E, 2I, H] and [E, H, I], and so are
sharded on the expert dimension like every other parameter's dim 0: each rank stores whole experts (E / M each;
3 experts on 2 ranks: 2 + 1). Chosen over the hidden (or intermediate) dimension because
- a rank's shard is then a set of complete experts, the unit that expert parallelism places on a device and that
  vLLM's fused layers index ([E, ...] as well), so the weight sync sends contiguous whole experts per rank and a
  later expert-parallel learner (tokens exchanged all-to-all, each rank computing its own experts) could keep
  this storage without resharding;
- no special case is needed here, in checkpoints or in the sync plan, which all assume Shard(0).
The cost: ranks hold unequal shares when M does not divide E, and none at all beyond E ranks (with E = 128 in
Qwen3-MoE models that matters only past 128 ranks). Sharding is storage only: the all-gather in forward still
assembles every expert on every rank, as for dense weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # DTensor's own shard arithmetic
from torch._subclasses.fake_tensor import unset_fake_temporarily

from rlpipe.parallel.mesh import SHARD_DIM


@dataclass(frozen=True)
class MixedPrecision:
    """Master weights (and optimizer state) stay in the dtype the model was built in; forward and backward compute
    in `param_dtype` (parameters are cast before the all-gather, so it also halves its traffic for bf16); gradients
    are reduce-scattered in `reduce_dtype` and stored in the master dtype."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32


_gathering_enabled = True

# (original class, names of the parameters it owns) -> subclass exposing those names as gathering properties.
_sharded_classes: dict[tuple[type, tuple[str, ...]], type] = {}

_MIXED_PRECISION_ATTR = "_simple_fsdp_mixed_precision"

# A parameter carrying this attribute (set True) is replicated on every rank instead of sharded: small parameters
# that each rank needs whole outside forward (LoRA's A, rlpipe/training/lora.py). Its gradient is all-reduced.
REPLICATED = "_simple_fsdp_replicated"


@contextmanager
def gathering_disabled() -> Iterator[None]:
    """Within this block parameter attributes return the sharded DTensor parameters themselves: no collective, and
    in-place initialisation (`module.weight.normal_()`) reaches the stored shards."""
    global _gathering_enabled
    previous = _gathering_enabled
    _gathering_enabled = False
    try:
        yield
    finally:
        _gathering_enabled = previous


def shard_model(
    model: nn.Module, mesh: DeviceMesh, mp: MixedPrecision = MixedPrecision(), weights=None
) -> nn.Module:
    """Shard every parameter of `model` in place over `mesh` and make parameter reads gather; returns `model`.

    Every rank must call this with a model of identical structure; the values held by mesh rank 0 are the ones
    every rank ends up with, so ranks need not have built identical weights. First dims that the mesh does not
    divide are fine (DTensor pads internally; shards follow torch.chunk, e.g. 97 rows -> 49 + 48).
    Buffers stay plain, replicated tensors.
    With `weights` (rlpipe/models/hf.py `CheckpointWeights`) the model is on `meta` and each rank reads only its
    own rows of each parameter from the checkpoint, straight onto its device: no rank ever holds a whole model.
    """
    placements = _parameter_placements(mesh)
    sharded_by_original: dict[int, nn.Parameter] = {}  # one sharded parameter per shared original parameter
    master_dtypes: set[torch.dtype] = set()

    for module_name, module in model.named_modules():
        owned_names = tuple(name for name, param in module._parameters.items() if param is not None)
        if not owned_names:
            continue
        for name in owned_names:
            param = module._parameters[name]
            if isinstance(param, DTensor):
                raise ValueError(f"parameter {name!r} of {type(module).__name__} is already a DTensor; shard once")
            if id(param) not in sharded_by_original:
                # 0-dim parameters cannot be split; they are replicated and their gradient all-reduced.
                whole = param.dim() == 0 or getattr(param, REPLICATED, False)
                param_placements = [Replicate()] * mesh.ndim if whole else placements
                with torch.no_grad():
                    if weights is None:
                        shards = distribute_tensor(param.detach(), mesh, param_placements)
                    else:
                        full_name = f"{module_name}.{name}" if module_name else name
                        shards = _read_shard(weights, full_name, param.shape, mesh, param_placements)
                sharded_by_original[id(param)] = nn.Parameter(shards, requires_grad=param.requires_grad)
                if param.is_floating_point():
                    master_dtypes.add(param.dtype)
            module._parameters[name] = sharded_by_original[id(param)]
        module.__class__ = _sharded_class(type(module), owned_names)
        setattr(module, _MIXED_PRECISION_ATTR, mp)

    if any(dtype != mp.param_dtype for dtype in master_dtypes):
        # Activations entering the model must match the compute dtype of the gathered weights (F.linear does not
        # mix dtypes). Integer inputs such as token ids pass through unchanged.
        model.register_forward_pre_hook(_input_caster(mp.param_dtype), with_kwargs=True)
    return model


def _read_shard(weights, name: str, shape: torch.Size, mesh: DeviceMesh, placements) -> DTensor:
    """This rank's rows of the checkpoint weight `name` (full shape `shape`) as the DTensor `distribute_tensor`
    would have made of the whole tensor."""
    with unset_fake_temporarily():  # host arithmetic on the mesh, also where the tensors are fake (rlpipe/tpu/step.py)
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    rows = slice(offset[0], offset[0] + local_shape[0]) if len(shape) else None
    local = weights.read(name, rows).to(mesh.device_type)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=_contiguous_stride(shape))


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


def full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The unsharded weights, one whole tensor at a time, as plain tensors in their master dtype under the model's
    own (HF) names. Each is a collective: every rank must run through all of them, and every rank receives each
    whole tensor. The tensors never alias the model's storage, so later optimizer steps do not change them and
    writing to them does not change the model."""
    with torch.no_grad():
        for name, value in model.state_dict().items():
            if not isinstance(value, DTensor):
                yield name, value.clone()
                continue
            gathered = value.full_tensor()
            # When no communication is needed (a shard dimension of size 1, a replicated 0-dim parameter) DTensor
            # hands back the local shard itself.
            if gathered.untyped_storage().data_ptr() == value.to_local().untyped_storage().data_ptr():
                gathered = gathered.clone()
            yield name, gathered


def _parameter_placements(mesh: DeviceMesh) -> list[Placement]:
    """Shard(0) on the mesh's "shard" dimension, Replicate on any other (a 1-D mesh without names is all shard)."""
    names = mesh.mesh_dim_names
    if names is None:
        if mesh.ndim != 1:
            raise ValueError(f"a {mesh.ndim}-D mesh needs dimension names, one of them {SHARD_DIM!r}")
        return [Shard(0)]
    if SHARD_DIM not in names:
        raise ValueError(f"mesh dimensions {names} have no {SHARD_DIM!r} dimension")
    return [Shard(0) if name == SHARD_DIM else Replicate() for name in names]


def _sharded_class(original: type, parameter_names: tuple[str, ...]) -> type:
    """Cached so that every Linear with a bias shares one subclass (and torch.compile sees few distinct types)."""
    key = (original, parameter_names)
    if key not in _sharded_classes:
        attributes = {name: _gathering_property(name) for name in parameter_names}
        attributes["__module__"] = original.__module__
        _sharded_classes[key] = type(f"Sharded{original.__name__}", (original,), attributes)
    return _sharded_classes[key]


def _gathering_property(name: str) -> property:
    def gathered(module: nn.Module) -> torch.Tensor:
        # Must not raise AttributeError: Python would then fall back to nn.Module.__getattr__, which silently
        # returns the sharded parameter.
        param = module._parameters[name]
        if not _gathering_enabled or not isinstance(param, DTensor):
            return param
        return _all_gather(param, getattr(module, _MIXED_PRECISION_ATTR))

    return property(gathered, doc=f"`{name}` all-gathered in the compute dtype (sharded under gathering_disabled())")


def _all_gather(param: DTensor, mp: MixedPrecision) -> torch.Tensor:
    """The full parameter as a plain tensor in mp.param_dtype. Backward: the gradient is a per-rank partial sum,
    reduced (reduce-scatter over "shard", all-reduce over "replicate") in mp.reduce_dtype; DTensor's redistribute
    casts the result back to the parameter's own dtype, so `.grad` matches the master weights."""
    floating = param.is_floating_point()
    gathered = param.redistribute(
        param.device_mesh,
        [Replicate()] * param.device_mesh.ndim,
        forward_dtype=mp.param_dtype if floating else None,
        backward_dtype=mp.reduce_dtype if floating else None,
    )
    return gathered.to_local(grad_placements=[Partial("sum")] * param.device_mesh.ndim)


def _input_caster(dtype: torch.dtype):
    def cast_floating(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple takes its items positionally
            return type(value)(*(cast_floating(item) for item in value))
        if isinstance(value, (list, tuple)):
            return type(value)(cast_floating(item) for item in value)
        if isinstance(value, dict):
            return {key: cast_floating(item) for key, item in value.items()}
        return value

    def cast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast_floating(args), cast_floating(kwargs)

    return cast_inputs


# ------------------------------------------------------------------ PyTorch/XLA: the same layout on an SPMD mesh
#
# On xla the layout above is written as sharding annotations instead of DTensor collectives: one process drives all
# of its XLA devices as a 1-D ("shard",) SPMD mesh, every parameter (and its AdamW moments) is annotated Shard(0),
# each micro-batch's rows are split over the mesh, and XLA's SPMD partitioner turns the one traced step into a
# per-device program with the all-gathers at each use and the reduce-scatter of each gradient that SimpleFSDP
# spells out by hand. Why not the DTensor path with one replica per device: on PJRT's CPU client torch_xla 2.9 has no
# multi-process mode (`torch_xla.launch` starts one process and one thread per CPU device), and a 2-device
# all_gather through the "xla" process group from those threads aborted here in XLA's rendezvous ("Expected 2
# threads to join the rendezvous, but only 1 of them arrived"); SPMD is also what torch_xla recommends on TPU pods
# (one process per host).


def xla_spmd_mesh(devices: int):
    """This process's XLA devices as a ("shard",) SPMD mesh. Switches torch_xla into SPMD mode, which must happen
    before any XLA tensor exists; on CPU the device count comes from CPU_NUM_DEVICES."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    available = xr.global_runtime_device_count()
    if available != devices:
        raise ValueError(
            f"learner.ranks: {devices} XLA devices asked for, this process has {available} "
            "(on xla one process drives all of its devices as one SPMD mesh; on CPU set CPU_NUM_DEVICES)"
        )
    return xs.Mesh(np.arange(devices), (devices,), (SHARD_DIM,))


def shard_dim0_spmd(tensors, mesh) -> None:
    """Annotate each tensor as split along its first dimension over the mesh (0-d tensors stay replicated)."""
    import torch_xla.distributed.spmd as xs

    for tensor in tensors:
        if tensor.dim() > 0:
            xs.mark_sharding(tensor, mesh, (SHARD_DIM,) + (None,) * (tensor.dim() - 1))
