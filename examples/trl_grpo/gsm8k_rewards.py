"""The reward functions of train_trl.py, as TRL's GRPOTrainer takes them: called by keyword with the completions
and the dataset's columns (here `solution`), `**kwargs` for the rest, one float per completion. The dataset is
conversational, so each completion is `[{"role": "assistant", "content": text}]`.

rlpipe calls them the same way: its recipe (recipe.yaml) names them `gsm8k_rewards:correctness_reward` and
`gsm8k_rewards:format_reward`, found beside the recipe (or on PYTHONPATH).
"""

import re

# The final answer line the system prompt asks for: "#### 72".
FINAL_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def correctness_reward(completions, solution, **kwargs):
    """1.0 when the number after the last '####' equals the reference solution."""
    contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, expected in zip(contents, solution):
        answers = FINAL_ANSWER.findall(content)
        rewards.append(1.0 if answers and answers[-1].replace(",", "") == expected else 0.0)
    return rewards


def format_reward(completions, **kwargs):
    """0.2 when the completion ends with the '#### <number>' line."""
    pattern = re.compile(r"####\s*-?[\d,]*\.?\d+\s*$")
    return [0.2 if pattern.search(completion[0]["content"]) else 0.0 for completion in completions]
