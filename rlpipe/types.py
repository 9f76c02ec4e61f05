"""What flows between the roles: prompts → completions → scored groups → a padded train batch; and, inside the
learner, what the objective reads (`LossInputs`, `ModelOutputs`) and what it reports (`LossStats`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from rlpipe.models.packing import PackedLayout


@dataclass
class Prompt:
    sample_id: int  # stable index of the dataset row, so a resumed or retried step names the same sample
    question: str  # the prompt's text: the text itself, or the conversation's last user message
    token_ids: list[int]  # chat-templated, tokenized prompt, as the engine and the learner see it
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other fields (e.g. answer), for rewards
    messages: list[dict] | None = None  # a conversation's messages as templated (None for a text prompt)
    chat: list[dict] | None = None  # the messages templated, a text prompt's too (multi-turn episodes render them)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # data.chat_template_kwargs, for those renderings
    messages_as_text: bool = False  # data.special_tokens_in_prompts is text: for those renderings too

    @property
    def for_rewards(self) -> str | list[dict]:
        """The prompt as reward functions get it (TRL's convention): the text, or the conversation."""
        return self.question if self.messages is None else self.messages


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # the rollout engine's logprob of each sampled token
    text: str
    finish_reason: str  # "stop" or "length"
    policy_version: int
    # A multi-turn episode (rlpipe/tools.py) also has: `token_ids` holding the model's turns and the tool messages in
    # order, `mask` 1 on the model's tokens and 0 on the tools' (whose `logprobs` are 0.0), the prompt it was
    # rendered with its tools (`prompt_ids`), the conversation after the prompt (`messages`, what reward functions
    # get as the completion), its environment instance, and counts of turns, tool calls and failed tool calls.
    mask: list[int] | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict] | None = None
    environment: Any = None
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    # With a teacher (algo.distill_teacher): its log-prob of each token of `token_ids` given the ones before it;
    # None where it gave none (its call failed), and then the sample carries no distillation signal.
    teacher_logprobs: list[float] | None = None

    @property
    def model_tokens(self) -> int:
        """The tokens the model sampled (tool tokens not counted)."""
        return len(self.token_ids) if self.mask is None else sum(self.mask)


@dataclass
class Group:
    """One prompt with its group_size completions and, once scored, their rewards."""

    prompt: Prompt
    completions: list[Completion]
    rewards: list[float | None] = field(default_factory=list)  # None: no reward function could score it
    reward_parts: dict[str, list[float | None]] = field(default_factory=dict)
    # What functions kept per sample beside their scores ("function/key": a dict return's other keys, log_extra's).
    reward_extras: dict[str, list] = field(default_factory=dict)


@dataclass
class StepScores:
    """What scoring a step's groups reports beside the rewards it fills in: samples each reward function failed to
    score, the first error of each that failed, the means of what functions gave `log_metric`, by name, and the
    samples each function scored 0 because their own call ran out of time."""

    failures: dict[str, int]
    errors: dict[str, str]
    logged: dict[str, float] = field(default_factory=dict)
    timeouts: dict[str, int] = field(default_factory=dict)


class LoopRoles(Protocol):
    """What a loop drives of a run's roles: the GRPO loop's generation ahead of training (`Lookahead`) and the
    held-out evaluation. A run's `Roles` and `rlpipe eval`'s `EvalRoles` (actors/) both are one."""

    def generate(self, prompts: list[Prompt], n: int, **sampling) -> list[Group]:
        """`n` completions per prompt, every prompt's exactly once."""

    def start_generation(self, prompts: list[Prompt], n: int, **sampling) -> Any:
        """Generation sent off; the handle returned is for `finish_generation`."""

    def finish_generation(self, generation: Any) -> list[Group]: ...

    def seed(self, step: int) -> None:
        """Seed every engine's sampling for `step`."""

    def score(self, groups: list[Group], trainer_state: dict | None = None) -> StepScores:
        """Fill in the groups' rewards."""


@dataclass
class TrainBatch:
    """Prompt+completion sequences, right-padded; every per-token tensor is aligned with input_ids.

    Position t of a per-token tensor refers to the token input_ids[:, t] (predicted from the tokens before it),
    so position 0 never carries a loss.
    """

    input_ids: torch.Tensor  # [N, T] long
    completion_mask: torch.Tensor  # [N, T] bool: True where the token was sampled by the policy
    rollout_logprobs: torch.Tensor  # [N, T] float32, 0 outside the completion
    advantages: torch.Tensor  # [N] float32
    lengths: torch.Tensor  # [N] long: prompt + completion tokens
    # [N, T] float32: a teacher's log-probs of the completion tokens (on-policy distillation), equal to
    # rollout_logprobs where it gave none; None without a teacher
    teacher_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __reduce__(self):
        # Pickled (sent to a learner actor) as numpy arrays, never as torch objects: a learner in an environment of
        # its own may run another torch version than the driver, and torch's pickles are not promised across them.
        arrays = {name: getattr(self, name).numpy() for name in _TRAIN_BATCH_FIELDS if getattr(self, name) is not None}
        return _train_batch_from_arrays, (arrays,)

    def slice(self, start: int, stop: int) -> "TrainBatch":
        """Rows [start, stop), trimmed to their longest sequence so padding is not computed."""
        return self.take(slice(start, stop))

    def take(self, rows: slice | torch.Tensor) -> "TrainBatch":
        """The given rows (a slice, or a tensor of row indices), trimmed to their longest sequence."""
        width = int(self.lengths[rows].max())
        return TrainBatch(
            input_ids=self.input_ids[rows, :width],
            completion_mask=self.completion_mask[rows, :width],
            rollout_logprobs=self.rollout_logprobs[rows, :width],
            advantages=self.advantages[rows],
            lengths=self.lengths[rows],
            teacher_logprobs=None if self.teacher_logprobs is None else self.teacher_logprobs[rows, :width],
        )

    @classmethod
    def from_sequences(
        cls,
        prompts: list[list[int]],
        completions: list[list[int]],
        rollout_logprobs: list[list[float]],
        advantages: list[float],
        pad_id: int = 0,
        masks: list[list[int] | None] | None = None,
        teacher_logprobs: list[list[float]] | None = None,
    ) -> "TrainBatch":
        """`masks`: per completion, which of its tokens the policy sampled (1) and which a tool or environment added
        (0, never trained on); None: all of them. `teacher_logprobs`: per completion, a teacher's log-prob of each
        of its tokens (on-policy distillation); None: no teacher."""
        n = len(prompts)
        masks = masks or [None] * n
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
        width = max(lengths)
        input_ids = torch.full((n, width), pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.bool)
        logprobs = torch.zeros((n, width), dtype=torch.float32)
        teacher = None if teacher_logprobs is None else torch.zeros((n, width), dtype=torch.float32)
        for row, (prompt, completion, lps, sampled) in enumerate(zip(prompts, completions, rollout_logprobs, masks)):
            start, stop = len(prompt), len(prompt) + len(completion)
            input_ids[row, :start] = torch.tensor(prompt, dtype=torch.long)
            if completion:
                input_ids[row, start:stop] = torch.tensor(completion, dtype=torch.long)
                logprobs[row, start:stop] = torch.tensor(lps, dtype=torch.float32)
                if teacher is not None:  # none from the teacher: the rollout's own, a log-ratio of 0
                    taught = teacher_logprobs[row]
                    teacher[row, start:stop] = torch.tensor(lps if taught is None else taught, dtype=torch.float32)
            mask[row, start:stop] = True if sampled is None else torch.tensor(sampled, dtype=torch.bool)
        return cls(
            input_ids=input_ids,
            completion_mask=mask,
            rollout_logprobs=logprobs,
            advantages=torch.tensor(advantages, dtype=torch.float32),
            lengths=torch.tensor(lengths, dtype=torch.long),
            teacher_logprobs=teacher,
        )


_TRAIN_BATCH_FIELDS = ("input_ids", "completion_mask", "rollout_logprobs", "advantages", "lengths", "teacher_logprobs")


def _train_batch_from_arrays(arrays: dict) -> TrainBatch:
    # Ray hands over read-only views of its object store; the learner gets tensors it owns.
    return TrainBatch(**{name: torch.from_numpy(array.copy()) for name, array in arrays.items()})


@dataclass
class LossInputs:
    """What the objective reads besides the model's outputs, for some rows of a mini-batch (all of them, or one
    micro-batch's): per-token tensors [B, T] aligned with the rows' input_ids, per-row ones [B], and the mini-batch's
    totals (0-d), so that losses summed over micro-batches are the mini-batch's loss."""

    mask: torch.Tensor  # [B, T] bool: the tokens trained on
    advantages: torch.Tensor  # [B]
    rollout_logprobs: torch.Tensor  # [B, T]: the rollout engine's log-probs of the sampled tokens
    total_tokens: torch.Tensor  # 0-d: the trained tokens of the whole mini-batch
    total_seqs: torch.Tensor  # 0-d: the rows of the whole mini-batch
    old_logprobs: torch.Tensor | None = None  # [B, T]: the policy before the step's first update, when it moves
    # within a step (several optimizer steps); None: the training forward's own, detached
    ref_logprobs: torch.Tensor | None = None  # [B, T]: a frozen reference model's (a KL term)
    teacher_logprobs: torch.Tensor | None = None  # [B, T]: a teacher's (on-policy distillation)

    def map_rows(self, change: Callable[[torch.Tensor], torch.Tensor]) -> LossInputs:
        """`change` applied to every per-row and per-token tensor (cut, pad); the totals stay as they are."""
        return replace(self, **{name: change(value) for name, value in self._tensors() if value.dim() > 0})

    def to(self, device: torch.device | str) -> LossInputs:
        return replace(self, **{name: value.to(device) for name, value in self._tensors()})

    def tensors(self) -> Iterator[torch.Tensor]:
        return (value for _, value in self._tensors())

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None)


@dataclass
class ModelOutputs:
    """What the model computed for one micro-batch.

    logprobs: [B, T] log-probability of each token given the ones before it (0 where not computed); carries grad.
    entropy: [B, T] the policy's entropy at each position (carries grad, for `algo.entropy_coef`).
    router_logits: a mixture-of-experts model's router logits, one [tokens, experts] tensor per MoE layer, over the
        tokens as the model ran them (packed or padded); empty for a dense model.
    router_mask: [tokens] which of those tokens are trained on (the `mask` tokens, in the same order).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    router_logits: list[torch.Tensor] = field(default_factory=list)
    router_mask: torch.Tensor | None = None


def _stat(metric: str | None = None, *, maximum: bool = False, optional: bool = False):
    """A `LossStats` field, reported under `metric` (per trained token; a maximum as it is) and combined by its sum,
    or by its largest value where `maximum`; an `optional` one is None where the objective has no such term."""
    metadata = {"metric": metric, "maximum": maximum}
    return field(default=None, metadata=metadata) if optional else field(metadata=metadata)


@dataclass(kw_only=True)
class LossStats:
    """What the objective reports for one micro-batch, as sums over its trained tokens (detached tensors). They add
    up over micro-batches, mini-batches and ranks (`combine`), except the fields declared maxima, and `metrics` turns
    the total into the step's figures. A field left None is not reported (its term is not part of the objective).

    Inside the step these are device tensors; what a learner rank sends back holds float64 CPU tensors, which pickle
    as numpy arrays (the driver may run another torch version)."""

    tokens: Tensor = _stat()  # trained tokens
    # tokens the policy loss clipped (set once it has run)
    clip_fraction: Tensor | None = _stat("clip_fraction", optional=True)
    entropy: Tensor = _stat("entropy")  # the policy's entropy
    # |old - rollout| log-prob: the learner's numbers against the rollout engine's; and the largest of those
    gap_abs: Tensor = _stat("logprob_gap/mean_abs")
    gap_max: Tensor = _stat("logprob_gap/max_abs", maximum=True)
    gap_kl: Tensor = _stat("logprob_gap/kl")  # k3 estimate of KL(rollout || learner) on its samples
    kl: Tensor | None = _stat("kl", optional=True)  # KL(policy || reference), the KL term's estimator
    # log p - log q on the sampled tokens: an estimate of KL(policy || teacher) (on-policy distillation)
    teacher_kl: Tensor | None = _stat("distill/teacher_kl", optional=True)
    # tokens masked importance sampling left out
    mis_dropped: Tensor | None = _stat("mis/dropped_fraction", optional=True)
    router_tokens: Tensor | None = _stat(optional=True)  # [MoE layers, experts]: routed copies of the trained tokens
    router_probability: Tensor | None = _stat(optional=True)  # [experts]: router probability, summed over layers

    def combine(self, other: LossStats) -> LossStats:
        """These and `other`'s together: sums added, maxima the larger (pure tensor code, for the compiled step)."""
        values = {}
        for name, maximum in _LOSS_STATS_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is None:
                values[name] = theirs
            elif theirs is None:
                values[name] = mine
            else:
                values[name] = torch.maximum(mine, theirs) if maximum else mine + theirs
        return LossStats(**values)

    def map(self, change: Callable[[Tensor], Tensor]) -> LossStats:
        """`change` applied to every field that is set."""
        return LossStats(**{name: change(value) for name, value in self._set()})

    def tensors(self) -> list[Tensor]:
        """The fields that are set, in declaration order (`with_tensors` puts such a list back)."""
        return [value for _, value in self._set()]

    def with_tensors(self, values: list[Tensor]) -> LossStats:
        """These stats with the set fields holding `values` (as `tensors` lists them) instead."""
        return LossStats(**{name: value for (name, _), value in zip(self._set(), values, strict=True)})

    def metrics(self) -> dict[str, float]:
        """The step's figures from stats summed over it: every sum per trained token, maxima as they are (nothing
        per token when no token was trained). The router's sums are read by the learner (expert load)."""
        tokens = float(self.tokens)
        figures = {"train_tokens": tokens}
        if not tokens:
            return figures
        for name, metric, maximum in _LOSS_STATS_METRICS:
            value = getattr(self, name)
            if value is not None:
                figures[metric] = float(value) if maximum else float(value) / tokens
        return figures

    def _set(self) -> list[tuple[str, Tensor]]:
        return [(name, getattr(self, name)) for name, _ in _LOSS_STATS_FIELDS if getattr(self, name) is not None]

    def __reduce__(self):
        return _loss_stats_from_arrays, ({name: value.numpy() for name, value in self._set()},)


# Read once here, so that the compiled step iterates over plain tuples.
_LOSS_STATS_FIELDS = tuple((f.name, f.metadata["maximum"]) for f in fields(LossStats))
_LOSS_STATS_METRICS = tuple(
    (f.name, f.metadata["metric"], f.metadata["maximum"]) for f in fields(LossStats) if f.metadata["metric"]
)


def _loss_stats_from_arrays(arrays: dict) -> LossStats:
    return LossStats(**{name: torch.from_numpy(array.copy()) for name, array in arrays.items()})


@dataclass
class TrainSums:
    """One learner rank's figures of a training step (or of one of its optimizer steps), as sums over its optimizer
    steps: the loss, the gradient norm before clipping, the learning rate, the steps themselves, the rows run, and
    the objective's stats (None where no micro-batch ran); a captured step (static shapes) adds its running counts
    of compiled graphs and graph breaks, which are the latest, not sums. `rlpipe.training.learner.combine_rank_metrics`
    turns every rank's into the step's metrics."""

    loss: float
    grad_norm: float
    lr: float
    optimizer_steps: float
    samples_run: float
    stats: LossStats | None = None
    compiles: float | None = None
    graph_breaks: float | None = None

    def then(self, later: TrainSums) -> TrainSums:
        """These sums with those of a later optimizer step of the same rank added."""
        return TrainSums(
            loss=self.loss + later.loss,
            grad_norm=self.grad_norm + later.grad_norm,
            lr=self.lr + later.lr,
            optimizer_steps=self.optimizer_steps + later.optimizer_steps,
            samples_run=self.samples_run + later.samples_run,
            stats=later.stats if self.stats is None else self.stats if later.stats is None else self.stats.combine(
                later.stats
            ),
            compiles=later.compiles,
            graph_breaks=later.graph_breaks,
        )


@dataclass
class MicroBatch:
    """The rows of one forward and backward pass, with what the objective reads about them and, for the packed
    variants, how they are packed."""

    input_ids: Tensor  # [B, T] right-padded
    loss_inputs: LossInputs
    lengths: Tensor | None = None  # [B] real tokens per row: the rows run packed (`PackedForward`)
    prompt_lengths: Tensor | None = None  # [B] with `lengths`: where each row's prompt ends, shared within a group
    layout: PackedLayout | None = None  # the rows packed to a static width (`StaticPackedForward`)

    def to(self, device: torch.device | str) -> MicroBatch:
        packing = (self.lengths, self.prompt_lengths, self.layout)
        lengths, prompts, layout = (None if value is None else value.to(device) for value in packing)
        return MicroBatch(self.input_ids.to(device), self.loss_inputs.to(device), lengths, prompts, layout)

    def tensors(self) -> Iterator[Tensor]:
        """Its tensors outside the packed layout (a strategy that splits rows splits these)."""
        yield self.input_ids
        yield from self.loss_inputs.tensors()
        yield from (value for value in (self.lengths, self.prompt_lengths) if value is not None)
