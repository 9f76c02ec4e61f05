"""Reward functions as TRL's documentation writes them (docs/source/quickstart and grpo_trainer.md, "Using a custom
reward function", TRL 1.16), bodies unchanged. The docs name several of them `reward_func`; here each gets a name of
its own. rlpipe must run them as they are: tests/unit/test_rewards.py and tests/integration/test_grpo_e2e.py."""

import asyncio
import re


# Quick start: rewards completions close to 20 characters (standard format).
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


# Example 1 (`reward_func`): longer completions, in tokens.
def token_count_reward(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


# Example 2: the DeepSeek-R1 format reward, for the conversational format.
def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


# Example 3 (`reward_func`): the answer in \boxed{} against the dataset's `ground_truth` column (standard format).
def boxed_ground_truth_reward(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


# Example 5: an async reward function.
async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


# Example 6 (`reward_func`): the optional `log_extra` / `log_metric` callables, which rlpipe passes as TRL does.
def logging_reward(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    extracted = [m.group(1) if m else None for m in extracted]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])

    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))

    return rewards
