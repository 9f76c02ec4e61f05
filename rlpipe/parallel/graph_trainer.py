"""The Graph Trainer: one optimizer step — forward, loss, backward, gradient clipping, AdamW — as one graph.

How the step is captured
------------------------
The step is an ordinary Python function handed to `torch.compile(fullgraph=True, dynamic=False)`. Inside it the
forward runs through the module itself, the user's loss function turns the outputs into a scalar, and the
gradients come from `torch.autograd.grad(loss, params)` on the real parameter tensors. Dynamo only traces
`autograd.grad` with `torch._dynamo.config.trace_autograd_ops` switched on, so every call runs under a config patch
that sets it. The gradients are clipped by their global norm and handed to `FunctionalAdamW`, an AdamW written as
in-place tensor arithmetic under `torch.no_grad()`; its moments and its step counter are plain tensors, so the
compiled graph takes them (and the parameters) as inputs and writes them back as in-place input mutations. One
graph, one launch per step, nothing left in Python between the backward and the update for the backend to miss.

Why this and not the alternatives:
- `loss.backward()` + `torch.optim.AdamW.step()` cannot be one graph: `Optimizer.step` always breaks the graph
  (its hooks, profiling and lazy state initialisation are Python), so the update would run as a second graph or
  eagerly, and `.grad` buffers would travel between the two.
- `torch.func.grad_and_value` over `functional_call` traces cleanly for plain tensors but fails once parameters
  are DTensors, which is how SimpleFSDP stores them. `autograd.grad` on the module's own parameters works for both,
  and the all-gather / reduce-scatter collectives of SimpleFSDP are then ordinary ops inside the same graph.
- A compiled forward with compiled autograd for the backward gives two graphs and still needs the optimizer
  outside.

What changes between calls and what does not. `dynamic=False` specialises the graph on every input shape, which
is what static-shape backends (XLA, TorchTPU) want, so sequence lengths must come from a small set: the caller pads
each batch to `rlpipe.models.packing.bucket_length(length, buckets)`, and each bucket compiles once. Values that change
every step — the learning rate, the optimizer step count, token normalisers inside the batch — are 0-d tensors,
never Python floats, because Dynamo specialises on Python scalars and would recompile for each new value. Dynamo's
recompile limit (8 by default) is raised to `len(buckets) + 2`, and hitting it raises instead of quietly running
the step eagerly from then on.

Micro-batching. `step` takes one batch or a list of micro-batches. The loop over the list is unrolled inside the
same graph: each micro-batch's loss is differentiated on its own (so only one micro-batch's activations need be
alive at a time) and the gradients are summed before clipping and the update. `loss_fn` must therefore scale each
micro-batch's loss so that the sum over micro-batches is the loss of the whole batch (for a token mean, divide by
the token count of the whole batch, not the micro-batch's). The reported loss is the sum over micro-batches and
the stats are combined by their own rule (`Stats.combine`: sums, or a maximum where the stats declare one), so
scale the stats the same way if you want batch-level values. The number of micro-batches is part of the graph: a
different count compiles a new graph.

`compile=False` runs the very same function eagerly (`learner.graph: false`), giving the same numbers up to
floating-point reassociation.

On a lazy device (`lazy=True`: xla, `rlpipe.hardware.device.Backend.lazy`) nothing is handed to Dynamo: the same function
runs on lazy XLA tensors, which record the whole step, and `rlpipe.hardware.device.step_boundary` turns the record into one
XLA program (see rlpipe/hardware/device.py for why).
The programs are cached by graph hash, so each bucket compiles once, as with Dynamo. There `compiles` counts XLA
compilations and `graph_breaks` counts programs beyond the one per step — each a host sync inside the step that cut
the record (an `.item()`, a data-dependent branch, an op XLA cannot lower) — and `xla_fallbacks` names the ops
that ran on the host.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self

import torch
from torch import Tensor, nn
from torch._functorch import config as functorch_config

# A micro-batch is whatever the loss function takes (a dict of tensors, a dataclass of them).
Batch = Any


class Stats(Protocol):
    """A loss function's statistics of one micro-batch (e.g. `rlpipe.types.LossStats`): tensors of any shape that
    know how they add up over micro-batches. A plain mapping of named tensors serves too; each of those adds up."""

    def combine(self, other: Self) -> Self:
        """Both micro-batches' stats in one (pure tensor code: it runs inside the compiled step)."""

    def tensors(self) -> list[Tensor]:
        """Every tensor held, in a fixed order."""

    def with_tensors(self, values: list[Tensor]) -> Self:
        """The same stats holding `values` (ordered as `tensors` lists them)."""


LossFn = Callable[[nn.Module, Batch], tuple[Tensor, Stats | Mapping[str, Tensor]]]

# Guards clip_coef = max_norm / (norm + eps) against a zero norm, as torch.nn.utils.clip_grad_norm_ does.
_CLIP_EPS = 1e-6


@dataclass
class StepReport:
    """What one optimizer step reports, read back in one host transfer: the loss and the gradient norm before
    clipping; the loss function's stats combined over the micro-batches, of the type it returned, holding float64
    CPU tensors (None without a micro-batch); and the trainer's running counts of compiled graphs and graph breaks."""

    loss: float
    grad_norm: float
    stats: Stats | Mapping[str, Tensor] | None
    compiles: float
    graph_breaks: float


class FunctionalAdamW:
    """AdamW whose state is plain tensors, so a compiled step can take it as graph inputs and update it in place.

    The arithmetic is `torch.optim.AdamW`'s: decoupled weight decay (p *= 1 - lr * wd), bias-corrected moments,
    eps added after the square root. The step counter is a float32 0-d tensor, as in torch's capturable AdamW, so
    the bias corrections are computed on device and a new step number never recompiles the graph.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        self.beta1, self.beta2 = (float(beta) for beta in betas)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        first = params[0] if params else None
        device = first.device if first is not None else None
        self.step = torch.zeros((), dtype=torch.float32, device=device)
        self.exp_avg = [torch.zeros_like(param, memory_format=torch.preserve_format) for param in params]
        self.exp_avg_sq = [torch.zeros_like(param, memory_format=torch.preserve_format) for param in params]

    @torch.no_grad()
    def update(self, params: Sequence[Tensor], grads: Sequence[Tensor], lr: Tensor) -> None:
        """One AdamW step of `params` in place, with `lr` a 0-d tensor."""
        self.step.add_(1)
        bias_correction1 = 1 - torch.pow(self.beta1, self.step)
        bias_correction2_sqrt = (1 - torch.pow(self.beta2, self.step)).sqrt()
        step_size = lr / bias_correction1
        for param, grad, exp_avg, exp_avg_sq in zip(params, grads, self.exp_avg, self.exp_avg_sq, strict=True):
            param.mul_(1 - lr * self.weight_decay)
            exp_avg.lerp_(grad, 1 - self.beta1)
            exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
            param.sub_(step_size * exp_avg / denom)

    def state_dict(self) -> dict:
        """Hyperparameters and state tensors (the live tensors, not copies: `torch.save` them or clone first)."""
        return {
            "betas": (self.beta1, self.beta2),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "step": self.step,
            "exp_avg": list(self.exp_avg),
            "exp_avg_sq": list(self.exp_avg_sq),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Copy saved state into the existing tensors, so a compiled step that holds them keeps seeing the same
        tensor objects (no recompile) and the values land in this optimizer's dtype and device."""
        for name in ("exp_avg", "exp_avg_sq"):
            ours, theirs = getattr(self, name), state[name]
            if len(ours) != len(theirs):
                raise ValueError(f"optimizer state has {len(theirs)} {name} tensors for {len(ours)} parameters")
            for index, (target, source) in enumerate(zip(ours, theirs)):
                if target.shape != source.shape:
                    raise ValueError(
                        f"{name}[{index}] has shape {tuple(source.shape)}, the parameter has {tuple(target.shape)}"
                    )
                target.copy_(source)
        self.step.copy_(torch.as_tensor(state["step"]))
        self.beta1, self.beta2 = (float(beta) for beta in state["betas"])
        self.eps = float(state["eps"])
        self.weight_decay = float(state["weight_decay"])


class _CompileCounter:
    """A backend wrapper that counts the graphs handed to the real backend."""

    def __init__(self, backend: str) -> None:
        self.backend = torch._dynamo.backends.registry.lookup_backend(backend)
        self.graphs = 0

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list[Tensor]):
        self.graphs += 1
        return self.backend(graph_module, example_inputs)


def _with_own_code(method: types.MethodType) -> types.MethodType:
    """`method` rebound to a private copy of its code object.

    Dynamo keeps compiled graphs, and counts recompiles against `recompile_limit`, per code object. Every
    GraphTrainStep shares `_train_step`'s code, so without a copy a second trainer in the same process (a test
    suite, a reference model, a restarted learner) would pile its graphs onto the first one's count and hit the
    limit; the copy also lets an instance's graphs be freed with it.
    """
    function = method.__func__
    code = function.__code__.replace()  # an equal but distinct code object
    private = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__)
    return types.MethodType(private, method.__self__)


def _graph_break_count() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


class GraphTrainStep:
    """Forward + loss + backward + global-norm clipping + AdamW of `model`, compiled as one graph per input shape.

    `loss_fn(model, batch) -> (loss, stats)` is pure tensor code (no `.item()`, no data-dependent Python
    branches); `stats` are tensors of any shape (see `Stats`), reported with the step (`StepReport`). See the module
    docstring for micro-batch scaling. `lazy`: the parameters live on a device that records ops (xla), whose step
    runs as one program at `rlpipe.hardware.device.step_boundary` instead of compiling. With `fullgraph=False`, a graph break
    no longer raises: the step then runs as several graphs and the metrics show it. `compiles` counts graphs
    compiled by this trainer; `graph_breaks` counts the breaks Dynamo met while compiling them (read from its
    process-wide counters during this trainer's calls), so both stay flat once every shape has been seen.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
        weight_decay: float,
        grad_clip: float,
        compile: bool = True,
        backend: str = "inductor",
        buckets: Sequence[int],
        fullgraph: bool = True,
        lazy: bool = False,
    ) -> None:
        if not buckets:
            raise ValueError("buckets must name at least one sequence length")
        self.model = model
        self.loss_fn = loss_fn
        self.lr = lr
        self.grad_clip = float(grad_clip)
        self.buckets = sorted(buckets)
        # Frozen parameters are neither differentiated nor updated, and hold no optimizer state.
        self.params = [param for param in model.parameters() if param.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (none requires grad)")
        self.optimizer = FunctionalAdamW(self.params, betas=betas, eps=eps, weight_decay=weight_decay)
        self.graph_breaks = 0
        self.device = self.params[0].device
        self.lazy = lazy
        self._xla_compiles = 0
        self.xla_fallbacks: dict[str, int] = {}
        if self.lazy:
            from rlpipe.hardware.device import step_boundary

            # The optimizer's zeros exist only as a record so far; materialised now, the first step's program takes
            # them as data like every later one, instead of compiling a one-off variant that builds them.
            step_boundary(self.device)
            self._counter = None
            self._step_fn = self._train_step
        elif compile:
            self._counter = _CompileCounter(backend)
            self._step_fn = torch.compile(
                _with_own_code(self._train_step), backend=self._counter, fullgraph=fullgraph, dynamic=False
            )
        else:
            self._counter = None
            self._step_fn = self._train_step

    @property
    def compiles(self) -> int:
        """Graphs compiled so far by this trainer (0 when eager; XLA programs on a lazy device)."""
        if self.lazy:
            return self._xla_compiles
        return self._counter.graphs if self._counter is not None else 0

    def _train_step(self, micro_batches: list[Batch], lr: Tensor) -> tuple[Tensor, Tensor, Stats | None]:
        grads: list[Tensor] | None = None
        total_loss: Tensor | None = None
        total_stats = None
        for batch in micro_batches:
            loss, stats = self.loss_fn(self.model, batch)
            stats = _rebuilt(stats, [value.detach() for value in _tensors(stats)])
            # allow_unused: eagerly, a parameter no token reached this time (an expert in the per-expert loop) has
            # no gradient; it gets zeros.
            micro_grads = torch.autograd.grad(loss, self.params, allow_unused=True)
            micro_grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, micro_grads)]
            if grads is None:
                grads = list(micro_grads)
            elif torch.compiler.is_compiling():
                grads = [acc + g for acc, g in zip(grads, micro_grads)]
            else:  # eager: in place, so one set of gradients is alive besides the micro-batch's own
                grads = [acc.add_(g) for acc, g in zip(grads, micro_grads)]
            loss = loss.detach()
            total_loss = loss if total_loss is None else total_loss + loss
            total_stats = stats if total_stats is None else _combined(total_stats, stats)
        if grads is None:  # no micro-batch: AdamW steps on zero gradients (momentum and weight decay still act)
            grads = [torch.zeros_like(param) for param in self.params]
            total_loss = torch.zeros((), device=self.device)
        return total_loss, self.clip_and_update(grads, lr), total_stats

    def clip_and_update(self, grads: list[Tensor], lr: Tensor) -> Tensor:
        """The step after the backward: clip `grads` (one per trainable parameter) by their global norm, then AdamW;
        returns the norm before clipping."""
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
        grad_norm = torch.linalg.vector_norm(torch.stack(norms))
        # As clip_grad_norm_: scale by min(1, max_norm / norm) without a data-dependent branch.
        clip_coef = torch.clamp(self.grad_clip / (grad_norm + _CLIP_EPS), max=1.0)
        grads = [g * clip_coef.to(g.dtype) for g in grads]
        self.optimizer.update(self.params, grads, lr)
        return grad_norm

    @staticmethod
    def _reported(loss: Tensor, grad_norm: Tensor, stats: Stats | None) -> Tensor:
        """Every number the step reports in one flat tensor, so reading them is one host transfer."""
        reported = [loss, grad_norm, *(_tensors(stats) if stats is not None else [])]
        # Under SimpleFSDP the gradient norm is a DTensor holding per-rank partial results.
        reported = [v.full_tensor() if hasattr(v, "full_tensor") else v for v in reported]
        return torch.cat([value.float().reshape(-1) for value in reported])

    def step(self, batch: Batch | list[Batch], lr: float | Tensor | None = None) -> StepReport:
        """One optimizer step over `batch` (or a list of micro-batches); `lr` defaults to the constructor's."""
        micro_batches = batch if isinstance(batch, list) else [batch]
        lr = self.lr if lr is None else lr
        lr_tensor = torch.as_tensor(lr, dtype=torch.float32, device=self.optimizer.step.device)
        breaks_before = _graph_break_count()
        if self.lazy:
            from rlpipe.hardware.device import step_boundary, xla_counters

            xla_before = xla_counters()
            loss, grad_norm, stats = self._step_fn(micro_batches, lr_tensor)
            values_tensor = self._reported(loss, grad_norm, stats)
            step_boundary(self.device)  # the step, its optimizer update and the metrics: one program
            spent = xla_counters() - xla_before
            self._xla_compiles += spent.compiles
            self.graph_breaks += max(0, spent.executions - 1)
            for op, count in spent.fallbacks:
                self.xla_fallbacks[op] = self.xla_fallbacks.get(op, 0) + count
        else:
            # Dynamo's settings for the captured step; an eager step leaves Dynamo alone (torch 2.9, which the xla
            # environment's eager reference runs on, has no trace_autograd_ops).
            settings = contextlib.nullcontext() if self._counter is None else torch._dynamo.config.patch(
                trace_autograd_ops=True,
                # One graph per bucket, plus slack for a changed micro-batch count or batch size.
                recompile_limit=len(self.buckets) + 2,
                fail_on_recompile_limit_hit=True,
            )
            # AOTAutograd's cache (its traced forward and backward, on disk beside inductor's) passes over any graph
            # holding a custom autograd.Function unless told otherwise; the step's own (the chunked log-prob) is pure
            # tensor code that Dynamo traces whole into the graph the cache is keyed by. Cached, a process compiling
            # a step another one compiled (a restarted rank, the next run) skips most of the compile.
            caching = contextlib.nullcontext() if self._counter is None else functorch_config.patch(
                autograd_cache_allow_custom_autograd_functions=True)
            with settings, caching:
                loss, grad_norm, stats = self._step_fn(micro_batches, lr_tensor)
            self.graph_breaks += _graph_break_count() - breaks_before
            values_tensor = self._reported(loss, grad_norm, stats)
        # float64: what the caller adds up over steps and ranks keeps every bit of each step's float32 numbers.
        values = values_tensor.cpu().double()
        if stats is not None:
            pieces, start = [], 2
            for value in _tensors(stats):
                pieces.append(values[start : start + value.numel()].reshape(value.shape))
                start += value.numel()
            stats = _rebuilt(stats, pieces)
        return StepReport(
            loss=float(values[0]), grad_norm=float(values[1]), stats=stats, compiles=float(self.compiles),
            graph_breaks=float(self.graph_breaks),
        )


# A loss function's stats are a `Stats`, or a mapping of named tensors that each add up.


def _tensors(stats: Stats | Mapping[str, Tensor]) -> list[Tensor]:
    return list(stats.values()) if isinstance(stats, Mapping) else stats.tensors()


def _rebuilt(stats: Stats | Mapping[str, Tensor], values: list[Tensor]) -> Stats | dict[str, Tensor]:
    return dict(zip(stats, values, strict=True)) if isinstance(stats, Mapping) else stats.with_tensors(values)


def _combined(total: Stats | Mapping[str, Tensor], stats: Stats | Mapping[str, Tensor]) -> Stats | dict[str, Tensor]:
    if isinstance(stats, Mapping):
        return {name: total[name] + value for name, value in stats.items()}
    return total.combine(stats)
