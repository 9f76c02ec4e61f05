"""A typical TRL GRPO script: Qwen3-0.6B on GSM8K in chat format, two reward functions, vLLM generation.

    python examples/trl_grpo/train_trl.py        (needs trl, vllm and a GPU)

Its rlpipe counterpart is recipe.yaml next to it; README.md maps this script to it line by line.
"""

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

from gsm8k_rewards import correctness_reward, format_reward

SYSTEM_PROMPT = "Solve the problem step by step. Give the final answer on its own last line as: #### <number>"


def to_conversation(example):
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": example["question"]},
        ],
        "solution": example["answer"].rpartition("####")[2].strip().replace(",", ""),
    }


def main():
    dataset = load_dataset("openai/gsm8k", "main", split="train")
    dataset = dataset.map(to_conversation, remove_columns=["question"])

    training_args = GRPOConfig(
        output_dir="runs/qwen3-0.6b-gsm8k",
        seed=42,
        learning_rate=1e-6,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=5,
        max_grad_norm=1.0,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=8,  # 64 completions per optimizer step: 8 prompts x 8 generations
        num_generations=8,
        max_completion_length=512,
        temperature=0.9,
        top_p=1.0,
        beta=0.04,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        reward_weights=[1.0, 1.0],
        max_steps=200,
        bf16=True,
        gradient_checkpointing=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        chat_template_kwargs={"enable_thinking": False},
        logging_steps=1,
        save_steps=50,
        save_total_limit=2,
        report_to="tensorboard",
    )
    trainer = GRPOTrainer(
        model="Qwen/Qwen3-0.6B",
        reward_funcs=[correctness_reward, format_reward],
        args=training_args,
        train_dataset=dataset,
    )
    trainer.train()


if __name__ == "__main__":
    main()
