"""GSM8K (question / answer ending in `#### <number>`) as chat-format train and test files that rlpipe reads.

    python examples/gsm8k/prepare.py                          # openai/gsm8k (config main) from the Hugging Face Hub
    python examples/gsm8k/prepare.py ~/gsm8k                  # a local copy: a folder of train*/test* files ...
    python examples/gsm8k/prepare.py gsm8k_train.jsonl --test-size 200   # ... or one file (its last 200 rows as test)

Each output row holds
  - `prompt`: the conversation, [{role: system, content: SYSTEM_PROMPT}, {role: user, content: question}];
  - `answer`: GSM8K's worked answer as it is, ending in `#### 72` (what rlpipe's built-in `numeric_answer` reads);
  - `solution`: the final answer alone, `72` (thousands commas removed; what TRL's `accuracy_reward` reads),
written to OUT/train.parquet and OUT/test.parquet (or .jsonl with --format jsonl). rlpipe reads that folder with
`data.path: OUT`, `data.prompt_field: prompt` and `data.eval_split: test` (examples/gsm8k/recipe.yaml).

Input is GSM8K's schema: rows with `question` and `answer` as json, jsonl or parquet files (a folder holding the
Hub's layout, `main/train-00000-of-00001.parquet`, is read from its `--subset` subfolder), or a Hub dataset name read
through `datasets`. Bad input (a missing file, a row without `####`, ...) is one line on stderr and exit status 2,
and then nothing is written. The script needs only the Python standard library, pyarrow (parquet) and, for the
Hub, `datasets`; it does not import rlpipe.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

SYSTEM_PROMPT = "Solve the problem step by step. Give the final answer on its own last line as: #### <number>"
HUB_DATASET = "openai/gsm8k"
SPLITS = ("train", "test")
_FORMATS = (".parquet", ".jsonl", ".json")


class InputError(Exception):
    """Input that cannot become the output; the message is one line."""


def final_answer(answer: str) -> str:
    """The text after the last `####`, thousands commas removed: `... #### 1,200` -> `1200`."""
    return answer.rpartition("####")[2].strip().replace(",", "")


def to_row(question: str, answer: str, system_prompt: str | None = SYSTEM_PROMPT) -> dict:
    """One GSM8K row in chat format, with the reference answer twice: worked (`answer`) and final (`solution`)."""
    prompt = [{"role": "system", "content": system_prompt}] if system_prompt else []
    prompt.append({"role": "user", "content": question})
    return {"prompt": prompt, "answer": answer, "solution": final_answer(answer)}


# ---------------------------------------------------------------- reading


def _read_file(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several types for a file that is not parquet
            raise InputError(f"{path}: cannot read as parquet: {_one_line(err)}") from None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise InputError(f"{path}: malformed JSON (line {err.lineno}: {err.msg})") from None
        return rows if isinstance(rows, list) else [rows]
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise InputError(f"{path} line {number}: malformed JSON ({err.msg})") from None
    return rows


def _split_files(folder: Path, split: str) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.startswith(split) and p.suffix in _FORMATS)


def _read_folder(folder: Path, subset: str) -> dict[str, list[dict]]:
    if (folder / subset).is_dir():  # the Hub's layout: one subfolder per config (main, socratic)
        folder = folder / subset
    splits = {}
    for split in SPLITS:
        files = _split_files(folder, split)
        if files:
            splits[split] = [row for file in files for row in _read_file(file)]
    if "train" not in splits:
        raise InputError(f"{folder}: no train*{'/'.join(_FORMATS)} file (GSM8K's layout: train and test files)")
    return splits


def _read_hub(name: str, subset: str) -> dict[str, list[dict]]:
    try:
        import datasets
    except ImportError:
        raise InputError(f"{name}: not a local file or folder, and reading it from the Hub needs `datasets`") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        loaded = datasets.load_dataset(name, subset)
    except Exception as err:  # offline, unknown name, unknown config: datasets raises many types
        raise InputError(
            f"{name}: not a local file or folder, and the Hub dataset cannot be read ({_one_line(err)}); "
            f"point SOURCE at a local copy"
        ) from None
    if "train" not in loaded:
        raise InputError(f"{name}: the Hub dataset has no train split (splits: {', '.join(loaded)})")
    return {split: loaded[split].to_list() for split in SPLITS if split in loaded}


def _looks_like_hub_name(source: str) -> bool:
    """`owner/name` (or `name`) with no file suffix and no path syntax: meant for the Hub, not as a local path."""
    if source.startswith((".", "/", "~")) or source.count("/") > 1 or Path(source).suffix in (*_FORMATS, ".json.gz"):
        return False
    return bool(source) and all(part and not part.startswith(".") for part in source.split("/"))


def read_source(source: str, subset: str) -> dict[str, list[dict]]:
    """{split: rows} from a file (all train), a folder or a Hub dataset."""
    path = Path(source).expanduser()
    if path.is_dir():
        return _read_folder(path, subset)
    if path.is_file():
        if path.suffix not in _FORMATS:
            raise InputError(f"{path}: not a {'/'.join(_FORMATS)} file")
        return {"train": _read_file(path)}
    if _looks_like_hub_name(source):
        return _read_hub(source, subset)
    raise InputError(f"{source}: no such file or folder")


# ---------------------------------------------------------------- checking and converting


def convert(rows: list, where: str, system_prompt: str | None) -> list[dict]:
    """GSM8K rows (question, answer with `#### N`) as chat rows; the first bad row stops it, named."""
    if not rows:
        raise InputError(f"{where}: no rows")
    converted = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise InputError(f"{where} row {index}: not an object with question and answer")
        missing = [key for key in ("question", "answer") if key not in row]
        if missing:
            raise InputError(
                f"{where} row {index}: no {' or '.join(missing)} field (it has {', '.join(sorted(row)) or 'none'}; "
                "GSM8K rows have question and answer)"
            )
        question, answer = row["question"], row["answer"]
        if not isinstance(question, str) or not question.strip():
            raise InputError(f"{where} row {index}: the question is empty or not text")
        if not isinstance(answer, str) or "####" not in answer:
            raise InputError(f"{where} row {index}: the answer has no '#### <final answer>' (GSM8K's answer format)")
        if not final_answer(answer):
            raise InputError(f"{where} row {index}: nothing follows the answer's '####'")
        converted.append(to_row(question, answer, system_prompt))
    return converted


def prepare(source: str, subset: str, system_prompt: str | None, test_size: int, limit: int | None) -> dict:
    """{split: chat rows}, checked; raises InputError."""
    splits = read_source(source, subset)
    if test_size:
        if "test" in splits:
            raise InputError(f"--test-size: {source} has a test split already")
        if test_size >= len(splits["train"]):
            raise InputError(f"--test-size: {test_size} leaves no training rows of {len(splits['train'])}")
        train = splits["train"]
        splits = {"train": train[:-test_size], "test": train[-test_size:]}
    if limit is not None:
        splits = {split: rows[:limit] for split, rows in splits.items()}
    return {split: convert(rows, f"{source} ({split} split)", system_prompt) for split, rows in splits.items()}


# ---------------------------------------------------------------- writing


def write(splits: dict[str, list[dict]], out: Path, fmt: str, overwrite: bool) -> dict[str, Path]:
    """Every split into a fresh folder beside `out`, then renamed to `out`: a failure leaves nothing behind."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out: {out} is a file")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InputError(f"--out: {out} is not empty (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        staging.chmod(0o777 & ~umask)  # mkdtemp's folder is private; the output is an ordinary one
        files = {}
        for split, rows in splits.items():
            files[split] = staging / f"{split}.{fmt}"
            if fmt == "parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                pq.write_table(pa.Table.from_pylist(rows), files[split])
            else:
                with files[split].open("w", encoding="utf-8") as lines:
                    lines.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {split: out / path.name for split, path in files.items()}


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prepare.py", description="GSM8K as chat-format train/test files for rlpipe (data.prompt_field: prompt)."
    )
    parser.add_argument("source", nargs="?", default=HUB_DATASET,
                        help=f"GSM8K json/jsonl/parquet file, folder of train*/test* files, or Hub name (default {HUB_DATASET})")
    parser.add_argument("--subset", default="main", help="Hub config, or subfolder of a folder that has one (default main)")
    parser.add_argument("--out", default="data/gsm8k-chat", help="output folder (default data/gsm8k-chat)")
    parser.add_argument("--format", choices=("parquet", "jsonl"), default="parquet", help="output files (default parquet)")
    parser.add_argument("--system-prompt", default=SYSTEM_PROMPT, help="system message of every prompt ('' for none)")
    parser.add_argument("--test-size", type=int, default=0, help="for a source without a test split: its last N rows")
    parser.add_argument("--limit", type=int, default=None, help="keep at most N rows of each split")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    args = parser.parse_args(argv)
    if args.test_size < 0 or (args.limit is not None and args.limit < 1):
        print("prepare.py: --test-size must be >= 0 and --limit >= 1", file=sys.stderr)
        return 2
    try:
        splits = prepare(args.source, args.subset, args.system_prompt or None, args.test_size, args.limit)
        files = write(splits, Path(args.out), args.format, args.overwrite)
    except InputError as err:
        print(f"prepare.py: {err}", file=sys.stderr)
        return 2
    print(", ".join(f"{split}: {len(splits[split])} rows -> {path}" for split, path in files.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
