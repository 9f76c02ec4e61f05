"""What the scorer role serves: each entry of reward.functions that a model scores (a reward model, the judge), by the
name its scores go by, and a distillation teacher (algo.distill_teacher), each with its model's local folder."""

from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass

from rlpipe.rewards.specs import JUDGE, is_model_reward, reward_names
from rlpipe.scoring.judge import JudgeSpec, judge_spec
from rlpipe.scoring.reward_model import check_reward_model, checked_tokenizer, model_folder
from rlpipe.scoring.teacher import TEACHER, WHERE


@dataclass(frozen=True)
class ServedModel:
    folder: str
    judge: JudgeSpec | None = None
    """The judge's settings; None for a reward model."""
    teacher: bool = False
    """A distillation teacher (rlpipe/scoring/teacher.py)."""


def served_models(functions: list, columns: list[str] | None = None, check: bool = False) -> dict[str, ServedModel]:
    """The entries of `functions` (RewardFunctionConfig or spec dicts) that a model scores, by name, their models'
    folders resolved (a Hub id fetched into the cache); with `check`, each refused in one line where it cannot serve
    (`check_reward_model`; a judge's kwargs against the dataset's `columns`, its model's config)."""
    specs = [asdict(f) if is_dataclass(f) else dict(f) for f in functions]
    served = {}
    for index, (spec, name) in enumerate(zip(specs, reward_names(specs))):
        where = f"reward.functions[{index}] {spec['name']}"
        if is_model_reward(spec["name"]):
            served[name] = ServedModel(model_folder(spec["name"], where))
            if check:
                check_reward_model(served[name].folder, where)
        elif spec["name"] == JUDGE:
            judge = judge_spec(dict(spec.get("kwargs") or {}), where, columns)
            served[name] = ServedModel(model_folder(judge.model, f"{where} kwargs.model"), judge)
            if check:
                check_judge_model(served[name].folder, f"{where} kwargs.model")
    return served


def served_teacher(teacher: str | None) -> dict[str, ServedModel]:
    """The teacher algo.distill_teacher names, under its name among the scorer's models; none without one."""
    if teacher is None:
        return {}
    return {TEACHER: ServedModel(model_folder(teacher, WHERE), teacher=True)}


def check_judge_model(folder: str, where: str) -> None:
    """A judge's model: a folder vLLM can start from, whose tokenizer has a chat template to render the request."""
    from rlpipe.models.checks import ModelFileError, check_links, safetensors_files
    from rlpipe.usercode.callables import RewardConfigError

    try:
        check_links(folder)
        safetensors_files(folder)
    except ModelFileError as err:
        raise RewardConfigError(f"{where}: {err}") from None
    if not checked_tokenizer(folder, where).chat_template:
        raise RewardConfigError(f"{where}: {folder}'s tokenizer has no chat template to put the judge's request in")
