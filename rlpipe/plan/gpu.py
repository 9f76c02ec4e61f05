"""The fullest GPU's memory (`gpu_peak`): what the learner rank and the engine placed on it hold, against
placement.gpu_memory_gib (rlpipe/hardware/gpu_layout.py says who shares which GPU).

- learner rank: the learner side's total per chip (rlpipe/plan/learner.py; a cuda rank is one chip).
- engine: what vLLM claims, engine_memory_fraction x the GPU's memory (rollout.gpu_memory_utilization of its share):
  a claim, taken whole at start. Without placement.gpu_memory_gib, the engine's own need (the rollout side's weights
  and KV cache) is shown instead, without a verdict.
An engine whose weights and KV cache exceed its claim is a problem (`gpu_problems_of_plan`): vLLM would start
with too small a cache, or not at all.
"""

from __future__ import annotations

from rlpipe.config import Config
from rlpipe.hardware.gpu_layout import engine_memory_fraction, gpu_layout
from rlpipe.plan.parts import GIB, MemoryItem, Peak, SidePlan


def gpu_peak(cfg: Config, learner: SidePlan, rollout: SidePlan) -> Peak | None:
    """The fullest GPU's memory, or None where no role runs on a GPU."""
    layout = gpu_layout(cfg)
    if not layout.on_gpus:
        return None
    gpu_bytes = None if cfg.placement.gpu_memory_gib is None else cfg.placement.gpu_memory_gib * GIB
    parts = []
    if layout.learner:
        parts.append(MemoryItem("gpu_learner", f"learner rank ({layout.learner:g} of the GPU)", learner.total_bytes))
    if layout.rollout:
        packed = 1 if layout.rollout >= 1 or layout.colocated else int(1 / layout.rollout)  # Ray packs shares
        engines = min(packed, layout.engines)
        if gpu_bytes is None:
            need = f"engine's weights + KV cache{f' x {engines}' if engines > 1 else ''}"
            parts.append(MemoryItem("gpu_engine", need, engines * rollout.total_bytes))
        else:
            fraction = engine_memory_fraction(cfg)
            claim = fraction * gpu_bytes
            label = f"engine's vLLM claim ({fraction:.3g} of the GPU)"
            parts.append(MemoryItem("gpu_engine", label + (f" x {engines}" if engines > 1 else ""), engines * claim))
    # A rank and an engine sharing a GPU add up; on GPUs of their own, the fuller one is the peak.
    apart = not layout.colocated
    title = f"the fullest GPU's memory ({layout.describe()}{'; each on GPUs of its own' if apart else ''})"
    if gpu_bytes is None:
        return Peak("gpu", "a GPU's memory", title, tuple(parts), None,
                    missing="placement.gpu_memory_gib is null: nothing states the GPUs' memory", largest_part=apart)
    return Peak("gpu", "a GPU's memory", title, tuple(parts), gpu_bytes,
                f"{cfg.placement.gpu_memory_gib:g} GiB (placement.gpu_memory_gib)", largest_part=apart)


def gpu_problems_of_plan(cfg: Config, rollout: SidePlan) -> list[str]:
    """An engine on a GPU whose weights and KV cache do not fit in what its vLLM claims."""
    layout = gpu_layout(cfg)
    if not layout.rollout or cfg.placement.gpu_memory_gib is None:
        return []
    fraction = engine_memory_fraction(cfg)
    claim = fraction * cfg.placement.gpu_memory_gib * GIB
    if rollout.total_bytes <= claim:
        return []
    return [f"rollout.gpu_memory_utilization: an engine's weights and KV cache take {rollout.total_gib:.2f} GiB, its "
            f"vLLM claims {claim / GIB:.2f} GiB ({fraction:.3g} of a {cfg.placement.gpu_memory_gib:g} GiB GPU)"]
