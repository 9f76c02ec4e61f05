"""The sparse mixture-of-experts MLP of Qwen3-MoE: a top-k softmax router and SwiGLU experts, no shared expert.

Parameter names and layouts are transformers 5's (`mlp.gate.weight` [E, H], `mlp.experts.gate_up_proj`
[E, 2I, H] with the gate half first, `mlp.experts.down_proj` [E, H, I]), which is also the fused layout vLLM's MoE
layers hold (`w13_weight`, `w2_weight`) and load directly. Hugging Face checkpoint files store one tensor per
expert and projection (`mlp.experts.<e>.gate_proj.weight`); `stack_expert_weights` / `split_expert_weights`
convert between the two at the file boundary (rlpipe/models/hf.py).

Routing is dropless: every token reaches its k experts (no capacity limit), as in transformers and vLLM, so the
learner's log-probs are the rollout engine's and no token is ever dropped.

Expert implementations (config `model.kernels.experts`):
- `torch` / `pallas`: the routed copies of the tokens are sorted by expert and each projection is one grouped
  matmul (rlpipe/kernels/gmm.py) over all experts at once; the shapes are static (tokens x k rows), so the
  Graph Trainer captures the layer in its one graph.
- `loop`: one slice of tokens per expert, gathered with a mask, as transformers' eager code does; the baseline
  of `rlpipe bench learner --experts N`, eager only (its shapes depend on the routing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlpipe.kernels.gmm import grouped_matmul

EXPERT_IMPLEMENTATIONS = ("torch", "pallas", "loop")


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits [N, E], routing weights [N, k] in x's dtype, chosen experts [N, k]) for x [N, H]."""
        logits = F.linear(x, self.weight)
        # Softmax in float32 whatever the compute dtype, as transformers and vLLM do, so that bf16 runs pick the
        # same experts on both sides.
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), chosen


class Experts(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Kept apart because under SimpleFSDP every read of a weight attribute is an all-gather, so each forward
        # reads each weight exactly once, never just for its shape.
        self.num_experts = num_experts
        self.impl = "torch"  # see EXPERT_IMPLEMENTATIONS; CausalLM.set_kernels sets it

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts of routing weight x expert(token), for x [N, H], chosen and
        weights [N, k]."""
        if self.impl == "loop":
            return self._per_expert_loop(x, chosen, weights)
        if self.impl not in EXPERT_IMPLEMENTATIONS:
            raise ValueError(
                f"model.kernels.experts: unknown implementation {self.impl!r}; choose one of "
                f"{', '.join(EXPERT_IMPLEMENTATIONS)}"
            )
        return self._grouped(x, chosen, weights)

    def _grouped(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        num_experts, top_k = self.num_experts, chosen.shape[1]
        flat_experts = chosen.reshape(-1)
        # Stable, so each expert's rows keep token order and the result does not depend on the sort's tie-breaking.
        order = flat_experts.argsort(stable=True)
        token_of_row = order // top_k
        # A scatter rather than bincount: bincount's output length depends on the data, which a graph cannot hold.
        group_sizes = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat_experts, torch.ones_like(flat_experts)
        )
        # The stored layouts are [E, out, in]; the grouped matmul multiplies rows by [E, in, out].
        gate_up = grouped_matmul(x[token_of_row], self.gate_up_proj.transpose(1, 2), group_sizes, self.impl)
        gate, up = gate_up.chunk(2, dim=-1)
        rows = grouped_matmul(F.silu(gate) * up, self.down_proj.transpose(1, 2), group_sizes, self.impl)
        rows = rows * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token_of_row, rows)

    def _per_expert_loop(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        gate_up_proj, down_proj = self.gate_up_proj, self.down_proj
        for expert in range(self.num_experts):
            token, slot = (chosen == expert).nonzero(as_tuple=True)
            if len(token) == 0:
                continue
            gate, up = F.linear(x[token], gate_up_proj[expert]).chunk(2, dim=-1)
            rows = F.linear(F.silu(gate) * up, down_proj[expert])
            out.index_add_(0, token, rows * weights[token, slot, None])
        return out


class SparseMoeBlock(nn.Module):
    """HF's `mlp.` of a Qwen3-MoE layer: `gate` (the router) and `experts`."""

    def __init__(self, config) -> None:
        super().__init__()
        self.gate = TopKRouter(config.hidden_size, config.num_experts, config.experts_per_token, config.norm_topk_prob)
        self.experts = Experts(config.hidden_size, config.moe_intermediate_size, config.num_experts)

    def routed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output shaped like x [..., H], router logits [tokens, E])."""
        flat = x.reshape(-1, x.shape[-1])
        logits, weights, chosen = self.gate(flat)
        return self.experts(flat, chosen, weights).view(x.shape), logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x)[0]


def expert_token_counts(router_logits: torch.Tensor, top_k: int, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Routed copies each expert receives [E] (float32) from one layer's router logits [N, E], counting only
    tokens where `token_mask` [N] is true (padding in a padded batch routes too but is no load of interest)."""
    chosen = router_logits.topk(top_k, dim=-1).indices
    counted = torch.ones_like(chosen, dtype=torch.float32)
    if token_mask is not None:
        counted = counted * token_mask.reshape(-1, 1).to(torch.float32)
    return torch.zeros(router_logits.shape[-1], dtype=torch.float32, device=router_logits.device).scatter_add_(
        0, chosen.reshape(-1), counted.reshape(-1)
    )


def router_probability_sums(router_logits: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Router probabilities [E] (float32) of one layer's router logits [N, E], summed over the tokens where
    `token_mask` [N] is true."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    if token_mask is not None:
        probs = probs * token_mask.reshape(-1, 1).to(torch.float32)
    return probs.sum(dim=0)


def balance_loss_from_sums(copies: torch.Tensor, probability: torch.Tensor, rows: torch.Tensor | float) -> torch.Tensor:
    """E x sum over experts of (routed copies / rows) x (summed probability / rows): the load-balancing loss from
    its sums, which add up over layers, micro-batches and ranks."""
    rows = torch.as_tensor(rows, dtype=torch.float32).clamp(min=1.0)  # no counted token (a padding pass): no loss
    return copies.shape[-1] * torch.sum((copies / rows) * (probability / rows))


def load_balancing_loss(
    router_logits: list[torch.Tensor], top_k: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss as transformers computes it for Qwen3-MoE, with routed copies and
    router probabilities pooled over all MoE layers' tokens; tokens where `token_mask` [N] is false are left
    out. Minimal (= k) when load and probability are uniform."""
    copies = sum(expert_token_counts(logits, top_k, token_mask) for logits in router_logits)
    probability = sum(router_probability_sums(logits, token_mask) for logits in router_logits)
    tokens = router_logits[0].shape[0] if token_mask is None else token_mask.sum().to(torch.float32)
    return balance_loss_from_sums(copies, probability, tokens * len(router_logits))


def stack_expert_weights(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (`...mlp.experts.<e>.{gate,up,down}_proj.weight`) replaced by the stacked
    `...mlp.experts.gate_up_proj` / `down_proj`; other names pass through. A layer whose experts are incomplete
    keeps its per-expert names, so the loader reports exactly which are missing."""
    per_layer: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for name, tensor in state.items():
        prefix, marker, rest = name.partition(".mlp.experts.")
        index, _, leaf = rest.partition(".")
        if marker and index.isdigit() and leaf in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            per_layer.setdefault(prefix + ".mlp.experts", {})[(int(index), leaf.split(".")[0])] = tensor
        else:
            out[name] = tensor
    for experts, parts in per_layer.items():
        wanted = [(e, proj) for e in range(num_experts) for proj in ("gate_proj", "up_proj", "down_proj")]
        if len(parts) != len(wanted) or any(key not in parts for key in wanted):
            out.update({f"{experts}.{e}.{proj}.weight": tensor for (e, proj), tensor in parts.items()})
            continue
        out[f"{experts}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(num_experts)]
        )
        out[f"{experts}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(num_experts)])
    return out


def split_expert_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `stack_expert_weights`: the per-expert names and tensors Hugging Face checkpoints hold."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            experts = name.removesuffix(".gate_up_proj")
            for index, matrix in enumerate(tensor):
                gate, up = matrix.chunk(2)
                out[f"{experts}.{index}.gate_proj.weight"] = gate.clone()  # safetensors refuses shared storage
                out[f"{experts}.{index}.up_proj.weight"] = up.clone()
        elif name.endswith(".mlp.experts.down_proj"):
            experts = name.removesuffix(".down_proj")
            for index, matrix in enumerate(tensor):
                out[f"{experts}.{index}.down_proj.weight"] = matrix.clone()
        else:
            out[name] = tensor
    return out
