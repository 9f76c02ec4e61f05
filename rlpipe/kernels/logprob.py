"""Log-probability (and entropy) of target tokens through the output projection, without [tokens x vocab] logits.

With z = hidden @ weight.T / temperature:  logprob_i = z_i[target_i] - logsumexp(z_i)  and
entropy_i = logsumexp(z_i) - sum_j softmax(z_i)_j z_ij.

- `reference`: the whole logits matrix, log_softmax, gather — the parity baseline; memory O(tokens x vocab).
- `chunked` (torch, the learner's default): the vocabulary in chunks with a running logsumexp; backward
  recomputes each chunk's logits rather than keeping them, so the extra memory is O(tokens x chunk).
- `pallas`: the same algorithm as Pallas kernels — grid (token blocks, vocab blocks) with the vocabulary as the
  reduction axis, whose per-row accumulators stay resident while the vocab blocks stream past — reached from
  torch through the `rlpipe::pallas_linear_logprob` custom op (a fake implementation for tracing, and autograd
  through two backward kernels: one reducing over vocab blocks for the hidden states, one over token blocks for
  the weight). Interpreted off TPU.

Entropy carries a gradient in `chunked` and `reference` (the entropy bonus, `algo.entropy_coef`, trains on it:
dH/dz_k = -p_k (log p_k + H)); `pallas` returns it detached, a metric only.
"""

from __future__ import annotations

import functools

import torch

from rlpipe.kernels._jax import call, jax_modules, round_up, run_kernel, tpu_compiler_params, with_autograd

IMPLEMENTATIONS = ("chunked", "reference", "pallas")
DEFAULT_CHUNK = 8192


def linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    impl: str = "chunked",
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H], weight [V, H], targets [N] -> (logprob [N], entropy [N]), both float32."""
    inv_temperature = 1.0 / temperature
    if impl == "reference":
        return reference_linear_logprob(hidden, weight, targets, inv_temperature)
    if impl == "chunked" or (impl == "pallas" and hidden.device.type == "xla"):  # see rlpipe/kernels/_xla.py
        return _ChunkedLinearLogprob.apply(hidden, weight, targets, inv_temperature, chunk)
    if impl == "pallas":
        targets = targets.to(torch.int32)
        logprob, entropy, _ = call(pallas_linear_logprob, _forward, hidden, weight, targets, inv_temperature)
        return logprob, entropy.detach()
    raise ValueError(f"model.kernels.logprob: unknown implementation {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")


def reference_linear_logprob(hidden, weight, targets, inv_temperature: float = 1.0):
    return logits_logprob(hidden @ weight.T, targets, inv_temperature)


def logits_logprob(logits, targets, inv_temperature: float = 1.0):
    """The same from logits [N, V] already computed (a model that only returns logits)."""
    logprobs = torch.log_softmax(logits.float() * inv_temperature, dim=-1)
    picked = logprobs.gather(-1, targets[:, None].long()).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return picked, entropy


class _ChunkedLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temperature, chunk):
        rows = hidden.shape[0]
        targets = targets.long()
        running_max = torch.full((rows,), float("-inf"), dtype=torch.float32, device=hidden.device)
        sum_exp = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
        weighted = torch.zeros_like(sum_exp)  # sum of exp(z - max) * z, for the entropy
        picked = torch.zeros_like(sum_exp)
        for start in range(0, weight.shape[0], chunk):
            logits = (hidden @ weight[start : start + chunk].T).float() * inv_temperature
            new_max = torch.maximum(running_max, logits.amax(-1))
            rescale = torch.exp(running_max - new_max)
            probs = torch.exp(logits - new_max[:, None])
            sum_exp = sum_exp * rescale + probs.sum(-1)
            weighted = weighted * rescale + (probs * logits).sum(-1)
            running_max = new_max
            picked = picked + _pick(logits, targets - start)
        lse = running_max + torch.log(sum_exp)
        entropy = lse - weighted / sum_exp
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.inv_temperature, ctx.chunk = inv_temperature, chunk
        ctx.set_materialize_grads(False)  # entropy unused in the loss (the usual case): no gradient work for it
        return picked - lse, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        inv_temperature = ctx.inv_temperature
        scaled = (grad_logprob.float() if grad_logprob is not None else torch.zeros_like(lse)) * inv_temperature
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, weight.shape[0], ctx.chunk):
            block = weight[start : start + ctx.chunk]
            logits = (hidden @ block.T).float() * inv_temperature
            # d logprob / d logits = onehot(target) - softmax;  d entropy / d logits = -softmax * (log softmax + H)
            log_softmax = logits - lse[:, None]
            grad_logits = -torch.exp(log_softmax) * scaled[:, None]
            if grad_entropy is not None:
                grad_logits -= torch.exp(log_softmax) * (log_softmax + entropy[:, None]) * (
                    grad_entropy.float()[:, None] * inv_temperature
                )
            local = targets - start
            inside = (local >= 0) & (local < logits.shape[1])
            grad_logits.scatter_add_(
                1, local.clamp(0, logits.shape[1] - 1)[:, None], torch.where(inside, scaled, 0.0)[:, None]
            )
            grad_logits = grad_logits.to(hidden.dtype)
            grad_hidden += (grad_logits @ block).float()
            if grad_weight is not None:
                grad_weight[start : start + ctx.chunk] = grad_logits.T @ hidden
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None


def _pick(logits: torch.Tensor, local_targets: torch.Tensor) -> torch.Tensor:
    """logits[i, local_targets[i]] where that column lies in this chunk, else 0 (static shapes: no masking by index)."""
    inside = (local_targets >= 0) & (local_targets < logits.shape[1])
    gathered = logits.gather(1, local_targets.clamp(0, logits.shape[1] - 1)[:, None]).squeeze(1)
    return torch.where(inside, gathered, 0.0)


# ------------------------------------------------------------------ Pallas

# Aimed at TPU: a [256, H] token block stays in VMEM while [512, H] vocab blocks stream past it.
BLOCK_TOKENS, BLOCK_VOCAB = 256, 512


def _block_sizes(rows: int, vocab: int, block_tokens: int, block_vocab: int) -> tuple[int, int]:
    return min(block_tokens, round_up(rows, 8)), min(block_vocab, round_up(vocab, 128))


def _scaled_logits(hidden_block, weight_block, vocab_index, block_vocab, vocab, inv_temperature):
    """This block's logits z [tokens, vocab block] in float32 and the mask of real (not padding) vocab columns."""
    jax, jnp, _ = jax_modules()
    logits = jax.lax.dot_general(
        hidden_block, weight_block, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    ) * inv_temperature
    columns = vocab_index * block_vocab + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    return logits, columns, columns < vocab


def _forward_kernel(
    hidden_ref, weight_ref, target_ref, max_ref, sum_ref, weighted_ref, picked_ref, *, vocab, block_vocab, inv_temperature
):
    _, jnp, pl = jax_modules()
    vocab_index = pl.program_id(1)

    @pl.when(vocab_index == 0)
    def _start():
        max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        weighted_ref[...] = jnp.zeros(weighted_ref.shape, jnp.float32)
        picked_ref[...] = jnp.zeros(picked_ref.shape, jnp.float32)

    logits, columns, real = _scaled_logits(
        hidden_ref[...], weight_ref[...], vocab_index, block_vocab, vocab, inv_temperature
    )
    logits = jnp.where(real, logits, -jnp.inf)
    old_max = max_ref[...]
    new_max = jnp.maximum(old_max, logits.max(axis=1, keepdims=True))
    rescale = jnp.exp(old_max - new_max)
    probs = jnp.exp(logits - new_max)
    sum_ref[...] = sum_ref[...] * rescale + probs.sum(axis=1, keepdims=True)
    weighted_ref[...] = weighted_ref[...] * rescale + jnp.where(real, probs * logits, 0.0).sum(axis=1, keepdims=True)
    picked_ref[...] += jnp.where(columns == target_ref[...], logits, 0.0).sum(axis=1, keepdims=True)
    max_ref[...] = new_max


def _logit_grads(hidden, weight, targets, lse, grad, vocab_index, block_vocab, vocab, inv_temperature):
    _, jnp, _ = jax_modules()
    logits, columns, real = _scaled_logits(hidden, weight, vocab_index, block_vocab, vocab, inv_temperature)
    probs = jnp.where(real, jnp.exp(logits - lse), 0.0)
    return ((columns == targets).astype(jnp.float32) - probs) * (grad * inv_temperature)


def _grad_hidden_kernel(hidden_ref, weight_ref, target_ref, lse_ref, grad_ref, out_ref, *, vocab, block_vocab, inv_temperature):
    jax, jnp, pl = jax_modules()
    vocab_index = pl.program_id(1)

    @pl.when(vocab_index == 0)
    def _start():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

    weight = weight_ref[...]
    grad_logits = _logit_grads(
        hidden_ref[...], weight, target_ref[...], lse_ref[...], grad_ref[...], vocab_index, block_vocab, vocab, inv_temperature
    )
    out_ref[...] += jnp.dot(grad_logits.astype(weight.dtype), weight, preferred_element_type=jnp.float32)


def _grad_weight_kernel(hidden_ref, weight_ref, target_ref, lse_ref, grad_ref, out_ref, *, vocab, block_vocab, inv_temperature):
    jax, jnp, pl = jax_modules()
    vocab_index, token_index = pl.program_id(0), pl.program_id(1)

    @pl.when(token_index == 0)
    def _start():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

    hidden = hidden_ref[...]
    grad_logits = _logit_grads(
        hidden, weight_ref[...], target_ref[...], lse_ref[...], grad_ref[...], vocab_index, block_vocab, vocab, inv_temperature
    )
    out_ref[...] += jax.lax.dot_general(
        grad_logits.astype(hidden.dtype), hidden, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )


def _padded(hidden, weight, column_arrays, block_tokens, block_vocab):
    """Inputs padded to whole blocks; per-token arrays become [rows, 1] columns."""
    _, jnp, _ = jax_modules()
    rows, vocab = hidden.shape[0], weight.shape[0]
    pad_rows, pad_vocab = round_up(rows, block_tokens) - rows, round_up(vocab, block_vocab) - vocab
    hidden = jnp.pad(hidden, ((0, pad_rows), (0, 0)))
    weight = jnp.pad(weight, ((0, pad_vocab), (0, 0)))
    columns = [jnp.pad(array, (0, pad_rows))[:, None] for array in column_arrays]
    return hidden, weight, columns


@functools.lru_cache(maxsize=None)
def _pallas_functions(inv_temperature: float, block_tokens: int, block_vocab: int, interpret_mode: bool):
    """Jitted forward and backward for one temperature and block size (shapes specialise inside jit)."""
    jax, jnp, pl = jax_modules()

    def specs(rows_axis: int):
        """BlockSpecs for (hidden, weight, per-token columns...) on a grid whose token axis is `rows_axis`."""
        vocab_axis = 1 - rows_axis

        def token_block(*grid):
            return (grid[rows_axis], 0)

        def vocab_block(*grid):
            return (grid[vocab_axis], 0)

        return token_block, vocab_block

    def forward(hidden, weight, targets):
        rows, vocab = hidden.shape[0], weight.shape[0]
        width = hidden.shape[1]
        bt, bv = _block_sizes(rows, vocab, block_tokens, block_vocab)
        hidden_p, weight_p, (targets_p,) = _padded(hidden, weight, [targets], bt, bv)
        token_block, vocab_block = specs(0)
        column = pl.BlockSpec((bt, 1), token_block)
        outputs = pl.pallas_call(
            functools.partial(_forward_kernel, vocab=vocab, block_vocab=bv, inv_temperature=inv_temperature),
            out_shape=[jax.ShapeDtypeStruct((hidden_p.shape[0], 1), jnp.float32)] * 4,
            grid=(hidden_p.shape[0] // bt, weight_p.shape[0] // bv),
            in_specs=[pl.BlockSpec((bt, width), token_block), pl.BlockSpec((bv, width), vocab_block), column],
            out_specs=[column] * 4,
            interpret=interpret_mode,
            compiler_params=tpu_compiler_params(),
        )(hidden_p, weight_p, targets_p)
        running_max, sum_exp, weighted, picked = (out[:rows, 0] for out in outputs)
        lse = running_max + jnp.log(sum_exp)
        return picked - lse, lse - weighted / sum_exp, lse

    def backward(hidden, weight, targets, lse, grad):
        rows, vocab = hidden.shape[0], weight.shape[0]
        width = hidden.shape[1]
        bt, bv = _block_sizes(rows, vocab, block_tokens, block_vocab)
        hidden_p, weight_p, columns = _padded(hidden, weight, [targets, lse, grad], bt, bv)
        grids = {"hidden": (hidden_p.shape[0] // bt, weight_p.shape[0] // bv)}
        grids["weight"] = grids["hidden"][::-1]
        kwargs = dict(vocab=vocab, block_vocab=bv, inv_temperature=inv_temperature)

        token_block, vocab_block = specs(0)
        grad_hidden = pl.pallas_call(
            functools.partial(_grad_hidden_kernel, **kwargs),
            out_shape=jax.ShapeDtypeStruct(hidden_p.shape, jnp.float32),
            grid=grids["hidden"],
            in_specs=[pl.BlockSpec((bt, width), token_block), pl.BlockSpec((bv, width), vocab_block)]
            + [pl.BlockSpec((bt, 1), token_block)] * 3,
            out_specs=pl.BlockSpec((bt, width), token_block),
            interpret=interpret_mode,
            compiler_params=tpu_compiler_params(),
        )(hidden_p, weight_p, *columns)
        token_block, vocab_block = specs(1)
        grad_weight = pl.pallas_call(
            functools.partial(_grad_weight_kernel, **kwargs),
            out_shape=jax.ShapeDtypeStruct(weight_p.shape, jnp.float32),
            grid=grids["weight"],
            in_specs=[pl.BlockSpec((bt, width), token_block), pl.BlockSpec((bv, width), vocab_block)]
            + [pl.BlockSpec((bt, 1), token_block)] * 3,
            out_specs=pl.BlockSpec((bv, width), vocab_block),
            interpret=interpret_mode,
            compiler_params=tpu_compiler_params(),
        )(hidden_p, weight_p, *columns)
        return grad_hidden[:rows].astype(hidden.dtype), grad_weight[:vocab].astype(weight.dtype)

    return jax.jit(forward), jax.jit(backward)


def _forward(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temperature: float, interpret_mode: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _pallas_functions(inv_temperature, BLOCK_TOKENS, BLOCK_VOCAB, interpret_mode)[0](hidden, weight, targets)


def _backward_pass(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_logprob: torch.Tensor,
    inv_temperature: float, interpret_mode: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    functions = _pallas_functions(inv_temperature, BLOCK_TOKENS, BLOCK_VOCAB, interpret_mode)
    return functions[1](hidden, weight, targets, lse, grad_logprob)


@torch.library.custom_op("rlpipe::pallas_linear_logprob", mutates_args=())
def pallas_linear_logprob(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob, entropy, logsumexp), each [N] float32."""
    return run_kernel(_forward, hidden, weight, targets, inv_temperature)


@pallas_linear_logprob.register_fake
def _(hidden, weight, targets, inv_temperature):
    return tuple(hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("rlpipe::pallas_linear_logprob_backward", mutates_args=())
def pallas_linear_logprob_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_logprob: torch.Tensor,
    inv_temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return run_kernel(_backward_pass, hidden, weight, targets, lse, grad_logprob, inv_temperature)


@pallas_linear_logprob_backward.register_fake
def _(hidden, weight, targets, lse, grad_logprob, inv_temperature):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, inv_temperature = inputs
    ctx.save_for_backward(hidden, weight, targets, output[2])
    ctx.inv_temperature = inv_temperature


def _backward(ctx, grad_logprob, grad_entropy, grad_lse):
    hidden, weight, targets, lse = ctx.saved_tensors
    grad_logprob = grad_logprob.float().contiguous()
    grad_hidden, grad_weight = call(
        pallas_linear_logprob_backward, _backward_pass, hidden, weight, targets, lse, grad_logprob, ctx.inv_temperature
    )
    return grad_hidden, grad_weight, None, None


with_autograd(pallas_linear_logprob, _forward, _backward, _setup_context, _backward_pass)
