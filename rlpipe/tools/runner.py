"""The rollout engine's episode runner, chosen once when the engine starts (`episode_runner`): `SingleTurn`, one
request per prompt for its completions, or `MultiTurn`, the recipe's tools and environments loaded in the engine's
process, each episode's prompt rendered with its tools, every live episode's next turn requested together, and tool
calls on threads the runner holds for the engine's life. A runner samples through the engine's `sample(prompts,
params)` (vLLM's requests, which a weight sync may abort) and answers with `Completion`s. It imports this package,
rlpipe.types and rlpipe's config, vLLM's input type when it samples and vLLM's tool parser where the model writes
calls in a format other than Hermes (formats.py); never the engine, which imports it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlpipe.config import RolloutConfig
from rlpipe.tools.calls import ToolThreads
from rlpipe.tools.episodes import Episode, EpisodeLimits, Turn, run_episodes
from rlpipe.tools.formats import TurnReader, tool_parser_for, turn_reader
from rlpipe.tools.loading import ToolSet
from rlpipe.tools.render import render_conversation
from rlpipe.types import Completion, Prompt

# vLLM's offline requests, run to their end or aborted: the outputs in the prompts' order, None where aborted.
Sample = Callable[[list, Any], list]


def _logprobs(sample, token_ids: list[int]) -> list[float]:
    return [step[token].logprob for step, token in zip(sample.logprobs, token_ids)]


class SingleTurn:
    """One completion per sample: each prompt's ids sampled `n` times in one request."""

    def run(self, prompts: list[Prompt], n: int, params, version: int, *, sample: Sample,
            tokenizer) -> list[list[Completion]]:
        """`n` completions per prompt, each with its sampled tokens' logprobs. A prompt whose requests a weight
        sync aborted comes back with no completions."""
        from vllm.inputs import TokensPrompt

        outputs = sample([TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts], params)
        groups = []
        for output in outputs:
            completions = []
            for sampled in output.outputs if output is not None else []:
                token_ids = list(sampled.token_ids)
                completions.append(Completion(token_ids, _logprobs(sampled, token_ids), _text(sampled, tokenizer),
                                              sampled.finish_reason or "length", version))
            groups.append(completions)
        return groups


def _text(sampled, tokenizer) -> str:
    """The completion's text, as its token ids read: vLLM cuts the text of a completion that a stop string ended at
    the string's end, while its last token may hold more."""
    if isinstance(sampled.stop_reason, str):
        return tokenizer.decode(sampled.token_ids, skip_special_tokens=True)
    return sampled.text


class _Aborted(Exception):
    """A sync aborted a turn's requests (`sync.on_generation: abort`)."""


class MultiTurn:
    """Episodes with the recipe's tools (rlpipe/tools/episodes.py). The tool calls of every episode this engine
    plays run on `threads`, so calls stuck past their time limit in one step still count in the next."""

    def __init__(self, toolset: ToolSet, cfg: RolloutConfig, read_turn: TurnReader | None = None):
        self.toolset, self.cfg = toolset, cfg
        self.threads = ToolThreads()
        # How a turn's tool calls are read (formats.py): made with the engine's tokenizer at the first episodes,
        # in the format rollout.tool_parser names or the chat template teaches.
        self._reader = read_turn

    def _read_turn(self, tokenizer, template_kwargs: dict) -> TurnReader:
        if self._reader is None:
            self._reader = turn_reader(tokenizer, tool_parser_for(tokenizer, self.cfg.tool_parser, template_kwargs))
        return self._reader

    def run(self, prompts: list[Prompt], n: int, params, version: int, *, sample: Sample,
            tokenizer) -> list[list[Completion]]:
        """`n` multi-turn episodes per prompt, every live episode's next turn submitted to the engine together. A
        sync that aborts generation aborts every episode: all prompts come back with no completions, to be
        regenerated."""
        from vllm.inputs import TokensPrompt

        episodes = []
        for prompt in prompts:
            for _ in range(n):
                environment = self.toolset.new_environment()
                messages = [dict(m) for m in prompt.chat or [{"role": "user", "content": prompt.question}]]
                if environment is not None and (
                    observation := environment.reset(prompt=prompt.for_rewards, **prompt.columns)
                ) is not None:
                    messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
                tools = self.toolset.episode_tools(environment)
                schemas = self.toolset.schemas(environment)
                ids = render_conversation(tokenizer, messages, schemas, prompt.messages_as_text,
                                          **prompt.template_kwargs)
                episodes.append(Episode(ids, {tool.__name__: tool for tool in tools}, environment))
        turn_params = params.clone()
        turn_params.n = 1

        def sample_turn(requests: list[tuple[list[int], int]]) -> list[Turn]:
            per_request = []
            for _, max_tokens in requests:
                request_params = turn_params.clone()
                request_params.max_tokens = max_tokens
                per_request.append(request_params)
            outputs = sample([TokensPrompt(prompt_token_ids=ids) for ids, _ in requests], per_request)
            if any(output is None for output in outputs):
                raise _Aborted
            turns = []
            for output in outputs:
                sampled = output.outputs[0]
                ids = list(sampled.token_ids)
                turns.append(Turn(ids, _logprobs(sampled, ids), sampled.text, sampled.finish_reason or "length"))
            return turns

        limits = EpisodeLimits(self.cfg.max_turns, params.max_tokens, self.cfg.max_model_len, self.cfg.tool_timeout_s,
                               self.cfg.max_tool_calls_per_turn, self.cfg.max_tool_time_per_episode_s)
        try:
            # One recipe's prompts share data.chat_template_kwargs: the tool messages render as its prompts did.
            template_kwargs = prompts[0].template_kwargs if prompts else {}
            run_episodes(episodes, sample_turn, tokenizer, limits, template_kwargs, self.threads,
                         self._read_turn(tokenizer, template_kwargs))
        except _Aborted:
            return [[] for _ in prompts]
        completions = [
            Completion(
                e.token_ids, e.logprobs, e.text, e.finish_reason, version, mask=e.mask, prompt_ids=e.prompt_ids,
                messages=e.messages, environment=e.environment, turns=e.turns, tool_calls=e.tool_calls,
                tool_errors=e.tool_errors,
            )
            for e in episodes
        ]
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]


def episode_runner(cfg: RolloutConfig) -> SingleTurn | MultiTurn:
    """The runner `rollout` asks for: multi-turn where it names tools, an environment factory or a verifiers task
    set's tools (loaded and checked here, in the engine's process, where the episodes run), else single-turn."""
    if not cfg.multi_turn:
        return SingleTurn()
    toolset = ToolSet.load(cfg.tools, cfg.environment_factory, cfg.verifiers_tools, tool_timeout_s=cfg.tool_timeout_s,
                           unsafe_no_sandbox=cfg.unsafe_no_sandbox)
    return MultiTurn(toolset, cfg)
