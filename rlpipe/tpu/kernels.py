"""TPU kernels compiled at a recipe's real shapes for a TPU generation, on a host without a TPU (`rlpipe rehearse`;
`python bench/tpu_compile.py` prints a table of them for several chips).

JAX's compile-only TPU topologies (`jax.experimental.topologies.get_topology_desc`, backed by libtpu) give devices
of a chip generation that nothing runs on; a function jitted with shardings over one of them is lowered and then
compiled by libtpu's XLA TPU compiler, Mosaic kernels included — the step that fails when a kernel's buffers do not
fit its scoped VMEM, which lowering alone never reaches.

A case is a JAX function with its arguments as `jax.ShapeDtypeStruct`s; each kernel kind's builder (`CASES`) makes
its forward and backward cases from a model's shapes, which come from a recipe and its model's config
(`recipe_shapes`): tokens = one learner pass on one rank (`rlpipe.plan.learner_sequence`: micro_batch_size
rows x the bucketed sequence length), the widths from the model's Hugging Face config.json. Adding a kernel is one
builder and one `CASES` entry; `recipe_cases` picks the ones a recipe's `model.kernels` runs.

VMEM: the compiler assigns each op of the program its scoped VMEM (the Mosaic kernel's pipelined blocks and
scratch, or an XLA fusion's working buffers) and records it, after code generation, as the op's
`used_scoped_memory_configs` (memory space 1 is VMEM). `Result` reports the largest such allocation of one
Mosaic kernel of the compiled program (`tpu_custom_call`: a Pallas kernel, or XLA's own ragged-dot kernel) and,
apart, of one other op: one op's VMEM at once, not a sum over the program. It is read from the after-codegen HLO
that the compile dumps (`xla_dump_to`); `compiled.memory_analysis()` counts HBM only, and the compiled program's
HLO text (`as_text()`) predates this assignment. A program that fails for lack of scoped VMEM shows the compiler's
own figures in its error (size needed, limit).
"""

from __future__ import annotations

import glob
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Chip generation -> the topology name of one chip.
CHIPS = {"v5e": "v5e:1x1", "v5p": "v5p:1x1x1", "v6e": "v6e:1x1"}
MIB = 2**20


@dataclass(frozen=True)
class ModelShapes:
    """What the cases need of a model and its recipe."""

    name: str
    rows: int  # sequences in one learner pass (per rank)
    seq: int  # tokens per sequence in that pass
    hidden: int
    vocab: int
    rms_eps: float
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    experts: int = 0  # 0: a dense model
    experts_per_token: int = 0
    expert_intermediate: int = 0

    @property
    def tokens(self) -> int:
        return self.rows * self.seq

    @property
    def routed_rows(self) -> int:
        """Rows the expert matmuls see: every token once per expert it is routed to."""
        return self.tokens * self.experts_per_token


def recipe_shapes(cfg, name: str = "") -> ModelShapes:
    """The shapes of the recipe `cfg` (a loaded `Config`) and of the model config.json its model.path resolves to
    (the downloaded folder, else configs/models/<name>.json), as `rlpipe plan` reads them."""
    from rlpipe.plan import architecture_source, learner_sequence

    rows, seq = learner_sequence(cfg)
    hf = json.loads(architecture_source(cfg.model.path).read_text())
    return ModelShapes(
        name=name, rows=rows, seq=seq, hidden=hf["hidden_size"], vocab=hf["vocab_size"], rms_eps=hf["rms_norm_eps"],
        heads=hf["num_attention_heads"], kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        experts=hf.get("num_experts", 0), experts_per_token=hf.get("num_experts_per_tok", 0),
        expert_intermediate=hf.get("moe_intermediate_size", 0),
    )


# ------------------------------------------------------------------ cases


@dataclass(frozen=True)
class Case:
    kernel: str  # "logprob fwd", ...
    shapes: str  # the model shapes, in words
    function: Callable
    args: tuple  # jax.ShapeDtypeStruct per argument of `function`


def _struct(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _vjp_case(kernel: str, shapes: str, forward: Callable, primals: tuple, fixed: tuple = ()) -> Case:
    """The backward of `forward(*primals, *fixed)` by jax.vjp, pulled back from a cotangent shaped like its output;
    `fixed` (integer inputs such as group sizes) are arguments of the compiled program but not differentiated. The
    program holds the forward it differentiates, as a training step does."""
    import jax

    out = jax.eval_shape(forward, *primals, *fixed)
    count = len(primals)

    def backward(*args):
        values, held, cotangent = args[:count], args[count:-1], args[-1]
        _, pullback = jax.vjp(lambda *p: forward(*p, *held), *values)
        return pullback(cotangent)

    return Case(kernel, shapes, backward, (*primals, *fixed, out))


def logprob_cases(m: ModelShapes) -> list[Case]:
    """rlpipe's fused log-prob kernel (rlpipe/kernels/logprob.py) and its own backward, for TPU (not interpreted)."""
    import jax.numpy as jnp

    from rlpipe.kernels import logprob

    n, h, v = m.tokens, m.hidden, m.vocab
    shapes = f"tokens {n} ({m.rows}x{m.seq}) x hidden {h} x vocab {v}"
    hidden, weight = _struct((n, h), jnp.bfloat16), _struct((v, h), jnp.bfloat16)
    targets, per_token = _struct((n,), jnp.int32), _struct((n,), jnp.float32)
    return [
        Case("logprob fwd", shapes, lambda x, w, t: logprob._forward(x, w, t, 1.0, False), (hidden, weight, targets)),
        Case("logprob bwd", shapes, lambda x, w, t, lse, g: logprob._backward_pass(x, w, t, lse, g, 1.0, False),
             (hidden, weight, targets, per_token, per_token)),
    ]


def rmsnorm_cases(m: ModelShapes) -> list[Case]:
    """rlpipe's RMSNorm kernel (rlpipe/kernels/rmsnorm.py) and its own backward."""
    import jax.numpy as jnp

    from rlpipe.kernels import rmsnorm

    n, h, eps = m.tokens, m.hidden, m.rms_eps
    shapes = f"tokens {n} ({m.rows}x{m.seq}) x hidden {h}"
    x, weight = _struct((n, h), jnp.bfloat16), _struct((h,), jnp.bfloat16)
    return [
        Case("rmsnorm fwd", shapes, lambda a, w: rmsnorm._forward(a, w, eps, False), (x, weight)),
        Case("rmsnorm bwd", shapes, lambda a, w, g: rmsnorm._backward_pass(a, w, g, eps, False), (x, weight, x)),
    ]


def splash_cases(m: ModelShapes) -> list[Case]:
    """JAX's splash attention as rlpipe runs it (rlpipe/kernels/attention.py; TorchTPU's splash_sdpa wraps the same
    kernel): the pass's rows each causal, and the same tokens packed end to end in one row with a segment id per
    document, forward and backward (the kernel's own dq and dkv kernels)."""
    import jax.numpy as jnp

    from rlpipe.kernels import attention

    cases = []
    for kind, batch, length in (("rows", m.rows, m.seq), ("packed", 1, m.tokens)):
        shapes = (f"{batch} x {length} tokens{' (' + str(m.rows) + ' documents)' if kind == 'packed' else ''}, "
                  f"{m.heads} q / {m.kv_heads} kv heads x {m.head_dim}")
        q = _struct((batch, m.heads, length, m.head_dim), jnp.bfloat16)
        kv = _struct((batch, m.kv_heads, length, m.head_dim), jnp.bfloat16)
        segments = _struct((batch, length), jnp.int32)
        cases.append(Case(f"splash {kind} fwd", shapes, lambda q, k, v, s: attention._forward(q, k, v, s, 0, False),
                          (q, kv, kv, segments)))
        cases.append(Case(f"splash {kind} bwd", shapes,
                          lambda q, k, v, s, g: attention._backward_pass(q, k, v, s, g, 0, False),
                          (q, kv, kv, segments, q)))
    return cases


def _expert_matmuls(m: ModelShapes) -> list[tuple[str, int, int]]:
    """(name, in, out) of the expert matmuls: gate and up together, then down."""
    h, e = m.hidden, m.expert_intermediate
    return [("gate+up", h, 2 * e), ("down", e, h)]


def _grouped_cases(kernel: str, m: ModelShapes, matmul: Callable) -> list[Case]:
    """Forward and vjp of `matmul(lhs [routed rows, in], rhs [experts, in, out], group_sizes [experts])` for each
    expert matmul of an MoE model (none for a dense one)."""
    import jax.numpy as jnp

    if not m.experts:
        return []
    cases = []
    group_sizes = _struct((m.experts,), jnp.int32)
    for name, width_in, width_out in _expert_matmuls(m):
        shapes = (f"{name}: routed rows {m.routed_rows} ({m.rows}x{m.seq}x{m.experts_per_token}), "
                  f"{width_in} -> {width_out}, {m.experts} experts")
        lhs = _struct((m.routed_rows, width_in), jnp.bfloat16)
        rhs = _struct((m.experts, width_in, width_out), jnp.bfloat16)
        cases.append(Case(f"{kernel} fwd", shapes, matmul, (lhs, rhs, group_sizes)))
        # the group sizes (integers, the router's counts) are an input of the backward program, not differentiated
        cases.append(_vjp_case(f"{kernel} bwd", shapes, matmul, (lhs, rhs), (group_sizes,)))
    return cases


def megablox_gmm_cases(m: ModelShapes) -> list[Case]:
    """JAX's megablox grouped matmul (Pallas; its custom vjp runs gmm and tgmm kernels)."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.megablox import ops

    def matmul(lhs, rhs, group_sizes):
        return ops.gmm(lhs, rhs, group_sizes, preferred_element_type=jnp.bfloat16)

    return _grouped_cases("megablox gmm", m, matmul)


def ragged_dot_cases(m: ModelShapes) -> list[Case]:
    """jax.lax.ragged_dot (XLA's own grouped matmul; torch.tpu.ops.ragged_dot is its torch face)."""
    import jax

    return _grouped_cases("ragged_dot", m, jax.lax.ragged_dot)


# Kernel kind -> its case builder; a builder returns [] for models it does not apply to.
CASES: dict[str, Callable[[ModelShapes], list[Case]]] = {
    "splash": splash_cases,
    "logprob": logprob_cases,
    "rmsnorm": rmsnorm_cases,
    "megablox_gmm": megablox_gmm_cases,
    "ragged_dot": ragged_dot_cases,
}


# ------------------------------------------------------------------ compiling


@dataclass
class Result:
    case: Case
    chip: str
    compiled: bool
    seconds: float
    kernel_vmem: int | None = None  # bytes: the largest scoped VMEM of one Mosaic kernel (tpu_custom_call)
    other_vmem: int | None = None  # bytes: the largest of one other op (an XLA fusion, copy, ...)
    model: str = ""
    error: str = ""  # one line, when not compiled


def topology_devices(chip: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(CHIPS[chip], "tpu").devices


def scoped_vmem(after_codegen_hlo: str) -> tuple[int | None, int | None]:
    """(largest Mosaic kernel, largest other op) scoped VMEM (memory space 1) in bytes that one op of an
    after-codegen HLO module was given; None where no such op reports any."""
    largest: dict[bool, int | None] = {True: None, False: None}
    # One op per instruction: a Mosaic kernel's printed config spans several lines.
    for op in re.split(r"\n(?=\s*(?:ROOT )?%)", after_codegen_hlo):
        found = re.search(r'"used_scoped_memory_configs":(\[[^\]]*\])', op)
        if not found:
            continue
        size = sum(int(c["size"]) for c in json.loads(found.group(1)) if str(c.get("memory_space")) == "1")
        mosaic = 'custom_call_target="tpu_custom_call"' in op
        if size and size > (largest[mosaic] or 0):
            largest[mosaic] = size
    return largest[True], largest[False]


def one_line_error(error: Exception) -> str:
    """The compiler's error in one line: its first line, and the line giving the VMEM figures when there is one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = f"{type(error).__name__}: {lines[0] if lines else ''}"
    figures = next((found.group(0) for line in lines[1:]
                    if (found := re.search(r"Scoped allocation with size .*?(exceeded .*? by [\d.]+\w?)", line))), "")
    return f"{first} {figures}".strip()


def compile_case(case: Case, chip: str, devices=None, model: str = "") -> Result:
    """Lower `case` for one chip of generation `chip` and compile it there (libtpu; no chip needed)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = topology_devices(chip) if devices is None else devices
    replicated = NamedSharding(Mesh(devices[:1], ("chip",)), PartitionSpec())
    with tempfile.TemporaryDirectory(prefix="tpu_compile_") as dump:
        started = time.perf_counter()
        try:
            lowered = jax.jit(case.function, in_shardings=(replicated,) * len(case.args)).lower(*case.args)
            lowered.compile(compiler_options={"xla_dump_to": dump})
        except Exception as error:  # noqa: BLE001 (the compiler's error is the result)
            return Result(case, chip, False, time.perf_counter() - started, model=model, error=one_line_error(error))
        seconds = time.perf_counter() - started
        hlo = "\n".join(Path(path).read_text() for path in sorted(glob.glob(f"{dump}/*after_codegen.txt")))
    return Result(case, chip, True, seconds, *scoped_vmem(hlo), model=model)


def recipe_cases(cfg, shapes: ModelShapes) -> list[Case]:
    """The kernels the recipe `cfg`'s learner step runs on TPU, forward and backward: splash attention as its rows
    reach it (packed with segment ids, or row by row), TorchTPU's ragged dot for the experts, and rlpipe's log-prob
    and RMSNorm kernels where `model.kernels` chooses them."""
    kernels = cfg.model.kernels
    cases = []
    if kernels.attention == "pallas":
        kind = "packed" if cfg.learner.packing else "rows"
        cases += [case for case in splash_cases(shapes) if case.kernel.startswith(f"splash {kind} ")]
    if kernels.logprob == "pallas":
        cases += logprob_cases(shapes)
    if kernels.rmsnorm == "pallas":
        cases += rmsnorm_cases(shapes)
    cases += ragged_dot_cases(shapes)  # on `tpu` tensors the experts' grouped matmul is TorchTPU's ragged dot
    return cases
