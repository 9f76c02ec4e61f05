"""On-policy distillation against GRPO alone, on tiny models this machine trains in seconds: a teacher (a tiny Qwen3
trained to add two numbers of 0-19) teaches a weaker student of the same shape and tokenizer (trained briefly on the
same sums); both arms run the same `rlpipe train` steps on the same prompts and seeds, with an exact-answer reward,
one with algo.distill_teacher set. Reported: each run's held-out greedy accuracy (prompts neither trained on)
before and after, and the teacher's own.

    python scripts/distill_lift.py --seeds 0 1 2 --steps 30 --out lift.json

A proxy for the recipe's question (does the teacher's dense signal help beyond the reward's?), not the recipe
itself (configs/distilled.yaml: SmolLM2-360M teaching SmolLM2-135M, which needs the model hub).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: the tests' tiny-model helpers

QUESTION = "Calculate {a} + {b}."


def sums() -> list[dict]:
    rows = [{"question": QUESTION.format(a=a, b=b), "answer": str(a + b)} for a in range(20) for b in range(20)]
    random.Random(0).shuffle(rows)
    return rows


def build_tokenizer(folder: Path, rows: list[dict]):
    from tokenizers import pre_tokenizers

    from rlpipe.bench.tiny_model import CHATML, train_tokenizer

    corpus = [f"user\n{row['question']}\nassistant\n{row['answer']}\n" for row in rows]
    digits_apart = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return train_tokenizer(folder, digits_apart, corpus, 300, CHATML)


def sft_rows(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """Each row as the engine renders it, with 1 on the answer's tokens and the end of the turn."""
    out = []
    for row in rows:
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}],
                                             add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


def model(folder: Path, tokenizer, rows: list[dict], seed: int, steps: int) -> str:
    from tests.tiny_tool_model import train_tiny_qwen3

    tokenizer.save_pretrained(folder)
    return train_tiny_qwen3(folder, tokenizer, sft_rows(tokenizer, rows), len(tokenizer), seed, steps, 5e-3)


def train_run(root: Path, name: str, student: str, data: Path, seed: int, steps: int, lr: float,
              teacher: str | None) -> dict:
    from rlpipe.config import load_config
    from rlpipe.run.controller import train

    overrides = [
        f"model.path={student}", f"run.output_dir={root}", f"run.name={name}", f"run.seed={seed}",
        "data.source=file", f"data.path={data}", "data.eval_size=80",
        "reward.functions=[{name: 'rlpipe.rewards.math:exact_match'}]", "rollout.group_size=8",
        "rollout.max_tokens=6", "rollout.max_model_len=64", "train.prompts_per_step=8", "train.micro_batch_size=16",
        f"train.steps={steps}", f"train.lr={lr}", "eval.every=0", "metrics.export=false", "metrics.tensorboard=false",
        "metrics.plot=false", "ray.num_cpus=4",
    ]
    if teacher:
        overrides += [f"algo.distill_teacher={teacher}", "scorer.max_model_len=64"]
    began = time.monotonic()
    train(load_config(None, overrides))
    summary = json.loads((root / name / "summary.json").read_text())
    return {"eval_before": summary["eval_before"], "eval_after": summary["eval_after"],
            "seconds": time.monotonic() - began}


def greedy_accuracy(folder: str, tokenizer, rows: list[dict]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    right = 0
    for (ids, mask), row in zip(sft_rows(tokenizer, rows), rows):
        prompt = torch.tensor([ids[: mask.index(1)]])
        out = lm.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
        right += tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True).strip() == row["answer"]
    return right / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--teacher-steps", type=int, default=1500)
    parser.add_argument("--student-steps", type=int, default=150)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = sums()
    train_rows, held_out = rows[:320], rows[320:]  # the file's last 80 rows are rlpipe's held-out set
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        tokenizer = build_tokenizer(root / "tokenizer", rows)
        teacher = model(root / "teacher", tokenizer, train_rows, 100, args.teacher_steps)
        student = model(root / "student", tokenizer, train_rows, 200, args.student_steps)
        data = root / "sums.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in train_rows + held_out))
        report = {"teacher_held_out": greedy_accuracy(teacher, tokenizer, held_out),
                  "student_held_out": greedy_accuracy(student, tokenizer, held_out), "runs": []}
        print(f"teacher {report['teacher_held_out']:.3f}, student {report['student_held_out']:.3f} held-out")
        for seed in args.seeds:
            for arm, taught_by in (("grpo", None), ("grpo+distill", teacher)):
                run = train_run(root / "runs", f"{arm}-{seed}", student, data, seed, args.steps, args.lr, taught_by)
                report["runs"].append({"arm": arm, "seed": seed, **run})
                print(f"{arm:>13} seed {seed}: held-out {run['eval_before']:.3f} -> {run['eval_after']:.3f} "
                      f"({run['seconds']:.0f} s)", flush=True)
    for arm in ("grpo", "grpo+distill"):
        after = [run["eval_after"] for run in report["runs"] if run["arm"] == arm]
        report[arm] = {"mean_after": statistics.mean(after), "after": after}
        print(f"{arm:>13}: held-out after {args.steps} steps, mean {statistics.mean(after):.3f} over {after}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
