"""`compute_score` functions written as verl's reward managers call them (data_source, solution_str, ground_truth,
extra_info -> float or {"score": ...}; BatchRewardManager's plural keywords -> a list), for the `verl` adapter
(rewards/verl.py). Nothing here knows rlpipe."""

import asyncio
import re


def _last_number(text):
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return numbers[-1] if numbers else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """GSM8K-like: the last number of the solution against the ground truth. `toy/sum` scores a float;
    `toy/sum-detailed` a dict with the prediction and the row's index from extra_info."""
    predicted = _last_number(solution_str)
    correct = predicted is not None and float(predicted) == float(ground_truth)
    if data_source == "toy/sum":
        return 1.0 if correct else 0.0
    if data_source == "toy/sum-detailed":
        return {"score": float(correct), "pred": predicted, "index": (extra_info or {}).get("index")}
    raise NotImplementedError(f"reward function is not implemented for data_source={data_source!r}")


def scaled_compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0, **kwargs):
    """`compute_score` times `scale`, a custom_reward_function.reward_kwargs-style argument."""
    return scale * float(compute_score("toy/sum", solution_str, ground_truth, extra_info))


async def async_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's reward loop awaits an async compute_score."""
    await asyncio.sleep(0.01)
    return compute_score(data_source, solution_str, ground_truth, extra_info)


def mutating_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """As verl's managers do to extra_info: it must not leak from one sample to another."""
    extra_info["calls"] = extra_info.get("calls", 0) + 1
    return float(extra_info["calls"])


def positional_only(solution_str, /):
    """Cannot take verl's keyword call."""
    return 0.0


def batch_compute_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
    """verl's BatchRewardManager form: one call, plural keywords, a list of scores."""
    return [scale * float(compute_score("toy/sum", text, truth, info))
            for text, truth, info in zip(solution_strs, ground_truths, extra_infos, strict=True)]


async def async_batch_compute_score(data_sources, solution_strs, ground_truths, extra_infos):
    await asyncio.sleep(0.01)
    return batch_compute_score(data_sources, solution_strs, ground_truths, extra_infos)


def batch_by_kwargs(**kwargs):
    """A batch function verl's manager can call that rlpipe cannot tell from its signature: `batch: true` says so."""
    return [float(len(text)) for text in kwargs["solution_strs"]]


def turn_info(data_source, solution_str, ground_truth, extra_info):
    """The keys verl's managers add to extra_info, as extras."""
    return {"score": 0.0, "num_turns": extra_info["num_turns"],
            "rollout_reward_scores": extra_info["rollout_reward_scores"]}


def scorer_file_form(solution_str, ground_truth):
    """As verl's own scorer files are written (verl/utils/reward_score/gsm8k.py): no data_source, no extra_info."""
    return float(_last_number(solution_str) == ground_truth)
