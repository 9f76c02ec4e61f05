"""The memory plan behind `rlpipe plan` and `rlpipe rehearse`: pure arithmetic on a resolved config and the model's
config.json, per chip and per host, against the TPU slices' HBM and the deploy manifests' pod memory and /dev/shm.
It owns the model's sizes (model_size.py), the learner's memory (learner.py), the engines' (engine.py), what a sync
sends (synced.py), /dev/shm (shm.py), the manifests' limits (pods.py), the figures' types (parts.py), the plan put
together (memory_plan.py) and its table and check lines (report.py). Where the runtime decides a figure, the plan
asks the module that decides it rather than restating its rule: the model's fields (rlpipe/models), the step's
forward variant and length buckets (forward.py, packing.py), whether the objective reads a reference (algo/), the
sender's buckets in flight (weightsync/sender.py). So it may import config, device, tpu_layout, models, forward,
packing, algo and weightsync, never the roles, Ray or vLLM; nothing in it builds a model or allocates memory, and
in rlpipe only the CLI and rlpipe/tpu/ import it."""

from rlpipe.plan.memory_plan import MemoryPlan, plan, plan_checks
from rlpipe.plan.model_size import MODELS_DIR, ModelSize, architecture_source, load_architecture
from rlpipe.plan.learner import learner_sequence
from rlpipe.plan.parts import GIB
from rlpipe.plan.report import LimitCheck, format_plan

__all__ = [
    "GIB",
    "LimitCheck",
    "MODELS_DIR",
    "MemoryPlan",
    "ModelSize",
    "architecture_source",
    "format_plan",
    "learner_sequence",
    "load_architecture",
    "plan",
    "plan_checks",
]
