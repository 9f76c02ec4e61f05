"""The built-in LLM judge: an entry `{name: judge, kwargs: {model: ...}}` of reward.functions has a generative model,
served by a vLLM engine in the scorer role, rate each completion.

- The judge reads one user message, `template` filled with `{question}` (a text prompt, or a conversation's last user
  message), `{completion}` (the completion's text, or an episode's last assistant message) and, where `reference`
  names a dataset column, `{reference}` (that column's value), rendered by the judge's own chat template.
- It replies under `temperature` (0: greedy, the default) with at most `max_tokens` tokens, after `reply_prefix`
  where one is given (written for it: `Score:` has a small judge reply with the number alone); the score is the last
  `Score: N` in the prefix and reply, a number from `min_score` to `max_score`, mapped onto 0..1.
- A reply without one, or with a number outside that range, leaves the sample unscored by the judge (counted under
  `reward/failures/<name>`, the first such reply logged); it is never scored 0. So is a request longer than the
  judge's context (`scorer.max_model_len` less `max_tokens`).
- Greedy requests identical to one already answered (the same filled template) are answered from a cache of the last
  CACHE_SIZE replies, by the judge that holds it.
"""

from __future__ import annotations

import functools
import re
import string
from collections import OrderedDict
from dataclasses import dataclass

from rlpipe.data.templating import templated_ids
from rlpipe.usercode.callables import RewardConfigError

JUDGE = "judge"
TEMPLATE_FIELDS = ("question", "completion", "reference")
SCORE = re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
CACHE_SIZE = 4096
_KWARGS = ("model", "template", "reference", "max_tokens", "temperature", "min_score", "max_score", "reply_prefix")


@dataclass(frozen=True)
class JudgeSpec:
    """A judge entry's kwargs, checked (`judge_spec`)."""

    model: str
    template: str
    reference: str | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    min_score: float = 0.0
    max_score: float = 10.0
    reply_prefix: str = ""
    """Text the judge's reply starts with, written for it (`Score:` has a small judge answer with the number alone)."""

    def prompt(self, question: str, completion: str, reference: object = None) -> str:
        fields = {"question": question, "completion": completion, "reference": "" if reference is None else reference}
        return self.template.format_map(fields)

    def read(self, reply: str) -> float | None:
        """The reply's score on 0..1, or None where it states none in range."""
        found = SCORE.findall(reply)
        if not found:
            return None
        value = float(found[-1])
        if not self.min_score <= value <= self.max_score:
            return None
        return (value - self.min_score) / (self.max_score - self.min_score)


def judge_spec(kwargs: dict, where: str, columns: list[str] | None = None) -> JudgeSpec:
    """A judge entry's kwargs checked, in one line naming `where`: `model` given, only known keys, a template whose
    fields are among TEMPLATE_FIELDS (`{reference}` only with `reference`), a score range, a reference column the
    dataset has (where its columns are known)."""
    unknown = sorted(set(kwargs) - set(_KWARGS))
    if unknown:
        raise RewardConfigError(f"{where}: the judge takes no {', '.join(unknown)} (its kwargs: {', '.join(_KWARGS)})")
    model = kwargs.get("model")
    if not isinstance(model, str) or not model.strip():
        raise RewardConfigError(f"{where}: the judge needs kwargs.model, the folder or Hub id of a model vLLM serves")
    reference = kwargs.get("reference")
    if reference is not None and not isinstance(reference, str):
        raise RewardConfigError(f"{where}: kwargs.reference names a dataset column, got {reference!r}")
    if reference is not None and columns is not None and reference not in columns:
        raise RewardConfigError(
            f"{where}: kwargs.reference {reference!r} is not a column of the dataset (its columns: "
            f"{', '.join(columns) or 'none'})"
        )
    low, high = kwargs.get("min_score", 0), kwargs.get("max_score", 10)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high))
    if not numbers or not low < high:
        raise RewardConfigError(f"{where}: kwargs.min_score must be a number below kwargs.max_score, got {low}, {high}")
    max_tokens, temperature = kwargs.get("max_tokens", 256), kwargs.get("temperature", 0.0)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RewardConfigError(f"{where}: kwargs.max_tokens must be a whole number >= 1, got {max_tokens!r}")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
        raise RewardConfigError(f"{where}: kwargs.temperature must be a number >= 0, got {temperature!r}")
    template = kwargs.get("template") or default_template(reference is not None, low, high)
    _check_template(template, reference, where)
    prefix = kwargs.get("reply_prefix", "")
    if not isinstance(prefix, str):
        raise RewardConfigError(f"{where}: kwargs.reply_prefix must be text, got {prefix!r}")
    return JudgeSpec(model.strip(), template, reference, max_tokens, float(temperature), float(low), float(high),
                     prefix)


def default_template(with_reference: bool, low: float, high: float) -> str:
    """The template a judge entry without kwargs.template uses."""
    against = ", judged against the reference answer" if with_reference else ""
    reference = "Reference answer:\n{reference}\n\n" if with_reference else ""
    return (
        f"Rate how well the response answers the question{against}.\n\nQuestion:\n{{question}}\n\n{reference}"
        f"Response:\n{{completion}}\n\nExplain briefly, then end with a line `Score: N`, where N is a whole number "
        f"from {low:g} (wrong or useless) to {high:g} (correct and complete)."
    )


def _check_template(template: object, reference: str | None, where: str) -> None:
    if not isinstance(template, str):
        raise RewardConfigError(f"{where}: kwargs.template must be text, got {type(template).__name__}")
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as err:
        raise RewardConfigError(f"{where}: kwargs.template cannot be filled ({err}; write {{{{ for a brace)") from None
    wrong = sorted({field for field in fields if field not in TEMPLATE_FIELDS})
    if wrong:
        raise RewardConfigError(
            f"{where}: kwargs.template has field(s) {', '.join(wrong)}; it may use {{question}}, {{completion}} and, "
            f"with kwargs.reference, {{reference}} (write {{{{ for a brace)"
        )
    if "reference" in fields and reference is None:
        raise RewardConfigError(f"{where}: kwargs.template uses {{reference}}; name its column in kwargs.reference")
    if "completion" not in fields:
        raise RewardConfigError(f"{where}: kwargs.template never shows the judge the {{completion}}")


def question_text(prompt) -> str:
    """What `{question}` shows: a text prompt, or a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return _text(users[-1]) if users else ""


def completion_text(completion) -> str:
    """What `{completion}` shows: the text, or the last assistant message of a conversation."""
    if isinstance(completion, str):
        return completion
    replies = [m.get("content") for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
    return _text(replies[-1]) if replies else ""


def _text(content) -> str:
    if isinstance(content, list):  # content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


class Judge:
    """A judge on a vLLM engine (`llm`, shared by the judges of one model); `context` the engine's max_model_len."""

    def __init__(self, llm, spec: JudgeSpec, context: int, seed: int = 0):
        from vllm import SamplingParams

        self.llm, self.spec, self.context = llm, spec, context
        self.tokenizer = llm.get_tokenizer()
        self.params = SamplingParams(temperature=spec.temperature, max_tokens=spec.max_tokens, seed=None)
        self.cache: OrderedDict[str, dict] = OrderedDict()

    def score(self, prompts: list, completions: list, columns: dict[str, list]) -> list[dict]:
        """`{"score": 0..1 or None, "reply": the judge's reply}` per sample (the reply is kept with the sample)."""
        references = columns.get(self.spec.reference) if self.spec.reference else None
        requests = [
            self.spec.prompt(question_text(p), completion_text(c), None if references is None else references[i])
            for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
        ]
        greedy = self.spec.temperature == 0
        asked = [r for r in dict.fromkeys(requests) if not (greedy and r in self.cache)]
        answers = dict(zip(asked, self._ask(asked)))
        if greedy:
            for request, answer in answers.items():
                self.cache[request] = answer
                self.cache.move_to_end(request)
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
            return [answers[r] if r in answers else self.cache[r] for r in requests]
        return [answers[r] for r in requests]

    def _render(self, request: str, keep) -> str:
        """The judge's prompt: the request as the user's message, the reply begun with reply_prefix. The request holds
        the dataset's and the policy's texts, so it stays text (`rlpipe.data.templating`): a completion that writes a
        special token's text cannot close the user's turn and write the judge's reply for it."""
        conversation = [{"role": "user", "content": keep(request)}]
        return self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False) + (
            self.spec.reply_prefix
        )

    def _ask(self, requests: list[str]) -> list[dict]:
        """The judge's score and reply for each request (score None: too long, or no score in its reply)."""
        ids = [templated_ids(self.tokenizer, functools.partial(self._render, request)) for request in requests]
        fits = [i for i, tokens in enumerate(ids) if len(tokens) + self.spec.max_tokens <= self.context]
        outputs = self.llm.generate([{"prompt_token_ids": list(ids[i])} for i in fits], self.params,
                                    use_tqdm=False) if fits else []
        too_long = {"score": None, "reply": f"(not asked: longer than the judge's {self.context} tokens)"}
        answers = [too_long] * len(requests)
        for index, output in zip(fits, outputs):
            reply = self.spec.reply_prefix + output.outputs[0].text
            answers[index] = {"score": self.spec.read(reply), "reply": reply}
        return answers


def start_judge_engine(folder: str, scorer) -> object:
    """vLLM's engine for a judge model in this process (`scorer`: the scorer section): on CPU, its KV cache of
    scorer.kv_cache_gib and prefix blocks of 32 tokens, as the rollout engines'."""
    from rlpipe.rollout.engine import CPU_KV_BLOCK_SIZE, engine_variables

    engine_variables(scorer.kv_cache_gib, in_process=True)
    from vllm import LLM
    from vllm.platforms import current_platform

    extra = {"block_size": CPU_KV_BLOCK_SIZE} if current_platform.is_cpu() else {}
    return LLM(
        model=folder, dtype=scorer.dtype, seed=0, max_model_len=scorer.max_model_len,
        enforce_eager=current_platform.is_cpu(), distributed_executor_backend="uni", use_tqdm_on_load=False, **extra,
    )
