"""rlpipe.config: defaults, the default recipe, YAML + dotted overrides, one-line errors that name the key, help."""

from pathlib import Path

import pytest
import yaml

from rlpipe.config import (
    Config,
    ConfigError,
    RewardFunctionConfig,
    describe,
    help_text,
    load_config,
)

DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


def _error(*overrides: str, recipe=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, list(overrides))
    message = str(info.value)
    assert "\n" not in message, f"config errors must be one line: {message!r}"
    return message


# ---------------------------------------------------------------- loading


def test_defaults_load_without_a_recipe():
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    assert cfg.run.name == "grpo"
    assert cfg.train.steps == 12
    assert cfg.rollout.group_size == 8
    assert cfg.samples_per_step == cfg.train.prompts_per_step * cfg.rollout.group_size == 64
    assert cfg.run_dir == Path("runs") / "grpo"
    assert [f.name for f in cfg.reward.functions] == ["rlpipe.rewards.reasoning_gym:verifier"]
    assert isinstance(cfg.reward.functions[0], RewardFunctionConfig)


def test_default_instances_do_not_share_mutable_defaults():
    a, b = load_config(None), load_config(None)
    a.train.betas.append(0.5)
    a.data.task_args["x"] = 1
    assert b.train.betas == [0.9, 0.999]
    assert b.data.task_args == {}


def test_default_recipe_loads_and_validates():
    cfg = load_config(DEFAULT_RECIPE)
    recipe = yaml.safe_load(DEFAULT_RECIPE.read_text())
    assert cfg.run.name == recipe["run"]["name"] == "smollm2-arithmetic"
    assert cfg.data.task_args == recipe["data"]["task_args"]
    for section in ("rollout", "train"):
        for key, value in recipe[section].items():
            assert getattr(getattr(cfg, section), key) == pytest.approx(value), f"{section}.{key}"
    assert cfg.reward.functions == [RewardFunctionConfig(name="rlpipe.rewards.reasoning_gym:verifier", weight=1.0)]


def test_default_recipe_asks_for_the_answer_its_verifier_scores():
    # The default recipe's prompts ask for the final number only, and rollout.max_tokens is sized for that reply:
    # a bare number is what reasoning-gym's scorer must take in full, on the held-out rows the evaluation reads.
    from rlpipe.data.prompts import load_rows, with_suffix
    from rlpipe.rewards.reasoning_gym import verifier

    cfg = load_config(DEFAULT_RECIPE)
    assert cfg.data.source == "reasoning_gym" and "number" in cfg.data.prompt_suffix
    train_rows, held_out = load_rows(cfg.data, cfg.run.seed)
    assert len(train_rows) == cfg.data.size and len(held_out) == cfg.data.eval_size
    assert not {row["question"] for row in held_out} & {row["question"] for row in train_rows}
    for row in held_out[:16]:
        assert with_suffix(row["question"], cfg.data.prompt_suffix).endswith(cfg.data.prompt_suffix)
        wrong = str(int(row["answer"]) + 1)
        assert verifier([row["answer"], f"{row['answer']}.", wrong], [row["entry"]] * 3) == [1.0, 1.0, 0.0]


def test_recipe_then_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run: {name: from-yaml}\ntrain: {steps: 7, lr: 1.0e-5}\n")
    cfg = load_config(
        recipe,
        [
            "train.steps=3",
            "train.betas=[0.8,0.9]",
            "reward.functions=[{name: 'rlpipe.rewards.math:numeric_answer', weight: 2}]",
            "algo.clip_high=1e-3",
            "train.mini_batch_size=null",
        ],
    )
    assert cfg.run.name == "from-yaml"  # from the recipe, untouched by overrides
    assert cfg.train.lr == pytest.approx(1e-5)
    assert cfg.train.steps == 3  # the override wins over the recipe
    assert cfg.train.betas == [0.8, 0.9]
    assert cfg.train.mini_batch_size is None
    (function,) = cfg.reward.functions
    assert isinstance(function, RewardFunctionConfig)
    assert function.name == "rlpipe.rewards.math:numeric_answer"
    assert function.weight == 2.0 and isinstance(function.weight, float)
    assert function.kwargs == {}


def test_exponent_without_a_dot_is_a_float():
    # YAML 1.1 reads `1e-3` as a string; a float key must still accept it.
    cfg = load_config(None, ["train.lr=1e-3", "rollout.temperature=1"])
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)


def test_an_empty_recipe_file_is_refused(tmp_path):
    recipe = tmp_path / "empty.yaml"
    recipe.write_text("# nothing\n")  # an emptied or truncated file would train with every default
    assert _error(recipe=recipe) == f"{recipe}: the recipe is empty"


def test_a_key_given_twice_is_refused_and_merges_still_override(tmp_path):
    recipe = tmp_path / "twice.yaml"
    recipe.write_text("train:\n  steps: 2\nrollout: {group_size: 4}\ntrain:\n  lr: 1.0e-5\n")
    assert _error(recipe=recipe) == f"{recipe}: duplicate key 'train' (line 4); give each key once"
    recipe.write_text("rollout: &common {group_size: 4, max_tokens: 64}\ntrain: {steps: 2}\n"
                      "algo: {loss: grpo, loss: dapo}\n")
    assert "duplicate key 'loss' (line 3)" in _error(recipe=recipe)
    recipe.write_text("rollout:\n  <<: {group_size: 4, max_tokens: 64}\n  max_tokens: 32\n")
    assert load_config(recipe).rollout.max_tokens == 32  # a merge's keys are meant to be overridden


def billion_laughs(levels: int = 9) -> str:
    """Reward kwargs whose last anchor stands for 9**levels strings, in levels + 1 lines."""
    lines = ['        l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"        l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, levels)]
    return "reward:\n  functions:\n    - name: format_tags\n      kwargs:\n" + "\n".join(lines) + "\n"


def test_aliases_that_stand_for_too_many_nodes_are_refused_as_the_recipe_is_read(tmp_path):
    recipe = tmp_path / "laughs.yaml"
    recipe.write_text(billion_laughs())
    message = _error(recipe=recipe)
    added = int(message.removeprefix(f"{recipe}: its aliases stand for ").split(" ", 1)[0])
    assert message.endswith(" nodes, more than the 10000 allowed") and added > 9**8
    reward = "[{name: format_tags, kwargs: {a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], b: &b [*a, *a, *a, *a, *a, *a, " \
             "*a, *a, *a, *a], c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b], d: [*c, *c, *c, *c, *c, *c, *c, *c, " \
             "*c, *c]}}]"
    assert _error(f"reward.functions={reward}").startswith("reward.functions: its aliases stand for ")
    recipe.write_text("reward:\n  functions:\n    - &me {name: format_tags, kwargs: {again: *me}}\n")
    assert _error(recipe=recipe) == f"{recipe}: an alias refers to the node that holds it"
    recipe.write_text("train: " + "[" * 5000 + "]" * 5000 + "\n")
    assert _error(recipe=recipe) == f"{recipe}: nests deeper than YAML's reader can follow"


def test_aliases_that_share_a_few_sections_load(tmp_path):
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(billion_laughs(levels=3) + "rollout: &sampling {temperature: 0.7}\neval:\n  <<: *sampling\n")
    functions = load_config(recipe).reward.functions
    assert functions[0].kwargs["l2"][8][8] == ["lol"] * 9  # 820 nodes once expanded


# ---------------------------------------------------------------- errors name the key


def test_unknown_top_level_section():
    message = _error("trian.steps=3")
    assert message.startswith("trian")
    assert "unknown key" in message


def test_unknown_section_in_a_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("bogus: {a: 1}\n")
    assert _error(recipe=recipe).startswith("bogus")


def test_unknown_nested_key():
    message = _error("train.stepz=3")
    assert message.startswith("train.stepz")
    assert "steps" in message  # lists the known keys


def test_unknown_key_in_a_reward_function():
    assert _error("reward.functions=[{name: x, wieght: 2}]").startswith("reward.functions[0].wieght")


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.steps=abc", "train.steps"),
        ("train.steps=1.5", "train.steps"),
        ("train.steps=true", "train.steps"),
        ("rollout.temperature=hot", "rollout.temperature"),
        ("metrics.plot=maybe", "metrics.plot"),
        ("train.betas=0.9", "train.betas"),
        ("data.task_args=5", "data.task_args"),
        ("reward.functions=[{name: x, weight: heavy}]", "reward.functions[0].weight"),
        ("train=3", "train"),
    ],
)
def test_wrong_type(override, key):
    assert _error(override).startswith(f"{key}:")


def test_bad_literal():
    message = _error("algo.loss_agg=foo")
    assert message.startswith("algo.loss_agg:")
    assert "token-mean" in message  # lists the allowed values


def test_batch_not_divisible_by_micro_batch():
    message = _error("train.prompts_per_step=3", "rollout.group_size=4", "train.micro_batch_size=5")
    assert message.startswith("train.micro_batch_size")


def test_mini_batch_must_divide_the_step():
    assert _error("train.mini_batch_size=5").startswith("train.mini_batch_size")


def test_mini_batch_must_be_positive():
    # -8 divides 64 and 8 divides -8: only an explicit range check catches it.
    assert _error("train.mini_batch_size=-8").startswith("train.mini_batch_size")


def test_mini_and_micro_batches_that_divide_are_accepted():
    cfg = load_config(None, ["train.mini_batch_size=16", "train.micro_batch_size=4"])
    assert (cfg.train.mini_batch_size, cfg.train.micro_batch_size) == (16, 4)


def test_the_trl_knobs_are_checked():
    assert _error("train.num_iterations=0").startswith("train.num_iterations")
    assert _error("algo.advantage_std=sample").startswith("algo.advantage_std")
    assert _error("train.lr_schedule=polynomial").startswith("train.lr_schedule")
    cfg = load_config(None, ["algo.kl_beta=0.04", "algo.kl_bias_correction=true", "algo.mask_truncated_completions=true",
                             "train.num_iterations=2", "train.lr_schedule=linear", "algo.advantage_std=population"])
    assert (cfg.algo.kl_bias_correction, cfg.algo.mask_truncated_completions, cfg.train.num_iterations) == (True, True, 2)


def test_group_size_one():
    assert _error("rollout.group_size=1").startswith("rollout.group_size")


def test_max_model_len_too_short():
    message = _error("rollout.max_model_len=300", "data.max_prompt_tokens=256")
    assert message.startswith("rollout.max_model_len")
    assert "384" in message  # 256 prompt + 128 completion tokens


def test_max_prompt_tokens_null_is_what_the_context_leaves():
    cfg = load_config(None, ["rollout.max_model_len=300", "rollout.max_tokens=100"])
    assert cfg.data.max_prompt_tokens is None and cfg.max_prompt_tokens == 200
    assert cfg.longest_sequence == 300
    message = _error("rollout.max_model_len=100")  # the default 128 completion tokens leave no prompt
    assert message.startswith("rollout.max_model_len: 100 leaves no room for a prompt after rollout.max_tokens 128")


@pytest.mark.parametrize(
    ("override", "start"),
    [
        ("rollout.top_k=0", "rollout.top_k: must be -1 (all tokens) or at least 1, got 0"),
        ("rollout.top_k=-2", "rollout.top_k: must be -1 (all tokens) or at least 1, got -2"),
        ("rollout.min_p=1.5", "rollout.min_p: must be in [0, 1], got 1.5"),
        ("rollout.min_p=-0.1", "rollout.min_p: must be in [0, 1]"),
        ("rollout.repetition_penalty=0", "rollout.repetition_penalty: must be > 0"),
        ("rollout.repetition_penalty=-1", "rollout.repetition_penalty: must be > 0"),
        ("rollout.stop=['']", "rollout.stop: a stop string must not be empty"),
        ("rollout.generation_kwargs={n: 4}", "rollout.generation_kwargs: n is not among"),
        ("rollout.generation_kwargs={logprobs: 5}", "rollout.generation_kwargs: logprobs is not among"),
        ("rollout.generation_kwargs={presence_penalty: 3}", "rollout.generation_kwargs: presence_penalty must be"),
        ("rollout.generation_kwargs={min_tokens: 500}", "rollout.generation_kwargs: min_tokens must be an integer"),
        ("rollout.generation_kwargs={stop_token_ids: [a]}", "rollout.generation_kwargs: stop_token_ids must be"),
        ("rollout.generation_kwargs={bad_words: ['']}", "rollout.generation_kwargs: bad_words must be"),
        ("data.max_prompt_tokens=0", "data.max_prompt_tokens: must be >= 1 (or null), got 0"),
        ("data.overlong=truncate", "data.overlong: 'truncate' is not one of 'error', 'drop'"),
    ],
)
def test_bad_sampling_and_prompt_length_values_are_one_line(override, start):
    assert _error(override).startswith(start)


def test_sampling_keys_load_and_choose_the_engines_logprobs():
    cfg = load_config(None, ["rollout.top_k=20", "rollout.min_p=0.05", "rollout.repetition_penalty=1.1",
                             "rollout.stop=['</answer>']", "rollout.generation_kwargs={stop_token_ids: [7]}"])
    rollout = cfg.rollout
    assert (rollout.top_k, rollout.min_p, rollout.repetition_penalty, rollout.stop) == (20, 0.05, 1.1, ["</answer>"])
    assert rollout.reshaping_keys() == ["top_k", "min_p", "repetition_penalty"]  # a stop token reshapes nothing
    assert rollout.logprobs_mode() == "raw_logprobs"  # the model's own, as the learner's at temperature 1
    plain = load_config(None, ["rollout.temperature=0.7", "rollout.stop=['</answer>']"]).rollout
    assert plain.reshaping_keys() == [] and plain.logprobs_mode() == "processed_logprobs"  # after temperature


def test_the_sampling_keys_reach_vllms_sampling_params_for_rollouts_and_the_greedy_evaluation():
    from rlpipe.rollout.engine import sampling_params

    rollout = load_config(None, [
        "rollout.top_k=20", "rollout.min_p=0.05", "rollout.repetition_penalty=1.1", "rollout.stop=['</answer>']",
        "rollout.generation_kwargs={presence_penalty: 0.5, frequency_penalty: 0.25, min_tokens: 2, "
        "stop_token_ids: [7], bad_words: [nope]}",
    ]).rollout
    for n, temperature in ((8, None), (1, 0.0)):
        params = sampling_params(rollout, n, temperature=temperature)
        assert (params.n, params.temperature, params.max_tokens, params.logprobs) == (
            n, 1.0 if temperature is None else 0.0, rollout.max_tokens, 0)
        # Greedy: vLLM itself drops the filters, which leave the most likely token where it is; the penalties stay.
        filters = (20, 0.05) if temperature is None else (0, 0.0)
        assert (params.top_k, params.min_p, params.repetition_penalty, params.stop) == (*filters, 1.1, ["</answer>"])
        assert params.include_stop_str_in_output  # the text keeps the stop string, as the token ids do
        assert (params.presence_penalty, params.frequency_penalty, params.min_tokens, params.bad_words) == (
            0.5, 0.25, 2, ["nope"])
        assert 7 in params.stop_token_ids


@pytest.mark.parametrize(
    ("reshaping", "name"),
    [("rollout.top_k=20", "rollout.top_k"), ("rollout.top_p=0.9", "rollout.top_p"),
     ("rollout.min_p=0.1", "rollout.min_p"), ("rollout.repetition_penalty=1.2", "rollout.repetition_penalty"),
     ("rollout.generation_kwargs={presence_penalty: 0.5}", "rollout.generation_kwargs.presence_penalty"),
     ("rollout.generation_kwargs={bad_words: [nope]}", "rollout.generation_kwargs.bad_words")],
)
def test_a_reshaping_key_needs_temperature_one(reshaping, name):
    message = _error(reshaping, "rollout.temperature=0.7")
    assert message.startswith(f"{name}: with {name} set, vLLM reports log-probs either after it or before temperature")
    assert "set rollout.temperature=1.0 (not 0.7)" in message
    assert load_config(None, [reshaping, "rollout.temperature=0"]).rollout.logprobs_mode() == "raw_logprobs"


def test_file_source_needs_a_path():
    assert _error("data.source=file").startswith("data.path")
    assert load_config(None, ["data.source=file", "data.path=x.jsonl"]).data.path == "x.jsonl"


@pytest.mark.parametrize("override", ["sync.bucket_mb=0", "sync.probe_tolerance=0", "sync.timeout_s=-1",
                                      "sync.transport=nccl", "sync.on_generation=wait"])
def test_bad_sync_settings_name_their_key(override):
    assert _error(override).startswith(override.split("=")[0] + ":")


def test_probe_tolerance_follows_the_rollout_dtype_unless_set():
    sync = load_config(None, []).sync
    assert sync.probe_tolerance_for("float32") == 1e-4 and sync.probe_tolerance_for("bfloat16") == 0.15
    assert load_config(None, ["sync.probe_tolerance=1e-5"]).sync.probe_tolerance_for("bfloat16") == 1e-5


def test_malformed_override():
    assert _error("train.steps").startswith("train.steps")


def test_malformed_yaml_file(tmp_path):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("train:\n  steps: [1, 2\n")
    message = _error(recipe=recipe)
    assert str(recipe) in message
    assert "malformed" in message


def test_missing_recipe_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    message = _error(recipe=missing)
    assert str(missing) in message
    assert "not found" in message


def test_top_level_list(tmp_path):
    recipe = tmp_path / "list.yaml"
    recipe.write_text("- train\n- steps\n")
    message = _error(recipe=recipe)
    assert str(recipe) in message
    assert "mapping" in message


@pytest.mark.parametrize("name", ["../escaped", "a/b", "/tmp/run", "..", ".", ""])
def test_a_run_name_must_be_one_folder_inside_the_output_dir(name):
    assert _error(f"run.name={name}").startswith(f"run.name: {name!r} must be one folder name inside run.output_dir")


@pytest.mark.parametrize("value", ["-0.1", "2.5", ".nan", ".inf"])
def test_temperature_is_bounded(value):
    assert _error(f"rollout.temperature={value}").startswith("rollout.temperature: must be between 0 (greedy) and 2")


def test_temperature_bounds_are_allowed():
    assert load_config(None, ["rollout.temperature=0"]).rollout.temperature == 0.0
    assert load_config(None, ["rollout.temperature=2"]).rollout.temperature == 2.0


# ---------------------------------------------------------------- help


def test_describe_lists_every_leaf_key_with_default_and_help():
    rows = {key: (default, meaning) for key, default, meaning in describe()}
    assert rows["train.micro_batch_size"] == ("8", "samples per forward/backward (gradient accumulation)")
    assert rows["algo.clip_high"][0] == "null" and "0.28" in rows["algo.clip_high"][1]  # the loss's own
    assert rows["ray.address"][0] == "null"
    assert rows["placement.reward.strategy"][0] == "SPREAD" and rows["placement.learner.strategy"][0] == "PACK"
    assert rows["train.betas"][0] == "[0.9, 0.999]"
    assert "rlpipe.rewards.reasoning_gym:verifier" in rows["reward.functions"][0]
    # Sections are not keys, and nested reward function fields are not separate keys.
    assert "train" not in rows and "reward.functions.name" not in rows
    assert not [key for key, (_, meaning) in rows.items() if not meaning.strip()]


def test_describe_covers_every_config_field():
    import dataclasses

    def leaves(cls, prefix):
        for f in dataclasses.fields(cls):
            made = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            nested = type(made) if dataclasses.is_dataclass(made) else None
            yield from leaves(nested, f"{prefix}{f.name}.") if nested else [f"{prefix}{f.name}"]

    expected = set(leaves(Config, ""))
    assert "model.kernels.logprob" in expected
    assert {key for key, _, _ in describe()} == expected


def test_help_text_shows_keys_defaults_and_meanings():
    text = help_text()
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    for key in ("train.micro_batch_size", "algo.clip_high", "reward.functions", "ray.address"):
        assert key in lines
    assert "[default: 8]" in lines["train.micro_batch_size"]
    assert "[default: null]" in lines["algo.clip_high"] and "0.28" in lines["algo.clip_high"]
    assert "clip-higher" in lines["algo.clip_high"]
    assert "[default: null]" in lines["ray.address"]


def test_text_overrides_keep_the_text_as_typed():
    cfg = load_config(None, ["data.system_prompt=#1 rule: be brief", "run.name=001", "model.tokenizer=null"])
    assert cfg.data.system_prompt == "#1 rule: be brief"
    assert cfg.run.name == "001"
    assert cfg.model.tokenizer is None


def test_a_section_with_no_keys_is_empty(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\nrun: {name: x}\n")
    cfg = load_config(recipe, ["train.steps=2"])
    assert cfg.train.steps == 2 and cfg.run.name == "x"


@pytest.mark.parametrize(
    "override, key",
    [
        ("placement.reward.tpu=v6e-8", "placement.reward.tpu"),
        ("placement.learner.topology=2x4", "placement.learner.topology"),
        ("placement.rollout.resources={rollout_host: -1}", "placement.rollout.resources"),
        ("placement.learner.strategy=EVERYWHERE", "placement.learner.strategy"),
        ("rollout.tensor_parallel=0", "rollout.tensor_parallel"),
        ("ray.placement_timeout_s=0", "ray.placement_timeout_s"),
    ],
)
def test_bad_placement_settings_name_their_key(override, key):
    assert _error(override).startswith(key + ":")


def test_engines_on_a_tpu_slice_must_ask_for_what_vllm_on_torchtpu_computes():
    """It computes in bfloat16 and reports log-probs before temperature (tests/tpu_contract reads both in its
    source)."""
    on_tpu = ["placement.rollout.tpu=v6e-8", "rollout.dtype=bfloat16", "rollout.temperature=1.0"]
    assert load_config(None, on_tpu).rollout.dtype == "bfloat16"
    assert _error(*on_tpu, "rollout.dtype=float32").startswith("rollout.dtype: vLLM on TorchTPU computes in bfloat16")
    message = _error(*on_tpu, "rollout.temperature=0.7")
    assert message.startswith("rollout.temperature: vLLM on TorchTPU") and "placement.rollout.tpu is set" in message
    assert _error(*on_tpu, "sync.probe=replay").startswith("sync.probe: replay needs log-probs of a given sequence")
    assert load_config(None, ["rollout.dtype=float32", "rollout.temperature=0.7"]).rollout.temperature == 0.7  # CPU


def test_tpu_recipes_load_and_a_tpu_learner_is_refused_where_no_tpu_is_available():
    cfg = load_config(None, ["learner.device=tpu", "placement.learner.tpu=v6e-8", "learner.ranks=8"])
    assert cfg.placement.learner.tpu == "v6e-8" and cfg.placement.reward.strategy == "SPREAD"
    from rlpipe.run.controller import prepare

    with pytest.raises(ConfigError, match=r"^learner.device: 'tpu' is not available to .*: cannot import torch_tpu"):
        prepare(cfg)


@pytest.mark.heavy
def test_a_device_is_asked_of_the_learners_own_environment(twin_python, monkeypatch):
    import sys

    import torch

    from rlpipe.hardware.device import device_unavailable
    from rlpipe.startup.preflight import check_learner_device

    assert device_unavailable("cpu") is None
    assert device_unavailable("xla").startswith("cannot import torch_xla")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_unavailable("cuda") == f"torch {torch.__version__} sees no CUDA GPU"
    # The check runs in the named interpreter, with the learner's environment variables, and names both.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match=rf"^learner.device: 'cuda' is not available to placement.learner.python "
                                          rf"{twin_python}: torch .* sees no CUDA GPU$"):
        check_learner_device(load_config(None, ["learner.device=cuda"]), twin_python)
    with pytest.raises(ConfigError, match=rf"the driver's environment {sys.executable}: cannot import torch_xla"):
        check_learner_device(load_config(None, ["learner.device=xla"]), None)
    check_learner_device(load_config(None, []), "/no/python/asked/for/cpu")


def test_the_clusters_resources_must_hold_the_roles():
    from rlpipe.startup.preflight import actors_needed, check_cluster_resources

    cfg = load_config(None, ["learner.ranks=2"])
    assert actors_needed(cfg) == 4  # two learner ranks, one engine, one reward worker
    # On xla one process drives every rank's device as an SPMD mesh.
    assert actors_needed(load_config(None, ["learner.device=xla", "learner.ranks=2"])) == 3
    check_cluster_resources(cfg, {"CPU": 4.0})
    with pytest.raises(ConfigError, match=r"^ray.num_cpus: the cluster has 3 CPUs but the roles need 4 "):
        check_cluster_resources(cfg, {"CPU": 3.0})
    cuda = load_config(None, ["learner.ranks=2", "learner.device=cuda"])
    with pytest.raises(ConfigError, match=r"^learner.device: the roles need 2 GPU\(s\) \(.*\), the cluster has 1$"):
        check_cluster_resources(cuda, {"CPU": 8.0, "GPU": 1.0})
    check_cluster_resources(cuda, {"CPU": 8.0, "GPU": 2.0})
    tpu = load_config(None, ["learner.device=tpu", "placement.learner.tpu=v6e-8", "learner.ranks=8"])
    with pytest.raises(ConfigError, match=r"^learner.device: the run needs TPU chips, the cluster at head:8265 has no TPU resource "
                                          r"\(resources: CPU, memory\)$"):
        check_cluster_resources(tpu, {"CPU": 64.0, "memory": 1e9, "node:10.0.0.1": 1.0}, "head:8265")
    check_cluster_resources(tpu, {"CPU": 1.0, "TPU": 8.0})  # slices bring their own CPUs
    with pytest.raises(ConfigError, match=r"^learner.ranks / rollout.num_engines / reward.num_workers: the cluster at "
                                          r"head:8265 has 3 CPUs but the roles need 4 "):
        check_cluster_resources(cfg, {"CPU": 3.0}, "head:8265")  # a cluster's CPUs are not ray.num_cpus


def test_asynchronous_mode_needs_an_importance_correction():
    assert load_config(None, ["train.max_staleness=1"]).train.max_staleness == 1  # tis_cap is on by default
    assert _error("train.max_staleness=-1").startswith("train.max_staleness:")
    message = _error("train.max_staleness=1", "algo.tis_cap=null")
    assert message.startswith("algo.tis_cap: asynchronous mode")


def test_graph_step_with_activation_checkpointing_takes_one_micro_batch_per_rank():
    # torch.compile rematerialises checkpointed layers for only one backward per graph.
    base = ("train.prompts_per_step=4", "rollout.group_size=4", "learner.ranks=2", "learner.activation_checkpointing=true")
    message = _error(*base, "learner.graph=true", "train.micro_batch_size=4")
    assert message.startswith("learner.activation_checkpointing with learner.graph")
    assert "train.micro_batch_size >= 8" in message
    assert load_config(None, [*base, "learner.graph=true", "train.micro_batch_size=8"]).learner.activation_checkpointing
    assert load_config(None, [*base, "train.micro_batch_size=4"]).train.micro_batch_size == 4  # eager: any micro-batch
    assert not load_config(None, []).learner.activation_checkpointing  # off by default


def test_mixed_precision_on_xla_is_refused_by_name():
    assert _error("learner.device=xla", "learner.param_dtype=bfloat16").startswith("learner.param_dtype: on xla")
    assert load_config(None, ["learner.device=xla", "learner.param_dtype=float32"]).learner.device == "xla"


def test_moe_settings_name_their_key():
    assert _error("model.kernels.experts=loop", "learner.graph=true").startswith("model.kernels.experts:")
    assert load_config(None, ["model.kernels.experts=loop"]).model.kernels.experts == "loop"  # eager: fine
    assert _error("model.kernels.experts=grouped").startswith("model.kernels.experts")
    tpu_step = ("learner.device=tpu", "learner.graph=true")
    assert _error(*tpu_step, "model.kernels.experts=torch").startswith("model.kernels.experts: 'torch' splits")
    assert load_config(None, ["learner.device=tpu", "model.kernels.experts=torch"])  # eager on tpu: fine
    assert load_config(None, list(tpu_step)).model.kernels.experts == "auto"  # a dense recipe need not name one
    assert _error("algo.router_aux_loss_coef=-1").startswith("algo.router_aux_loss_coef:")
    assert load_config(None, []).algo.router_aux_loss_coef is None


def test_chat_template_kwargs_need_a_template_and_leave_rlpipes_own_arguments():
    from rlpipe.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="data.chat_template_kwargs: data.chat_template is none"):
        load_config(None, ["data.chat_template=none", "data.chat_template_kwargs={enable_thinking: false}"])
    with pytest.raises(ConfigError, match="data.chat_template_kwargs: tokenize is set by rlpipe"):
        load_config(None, ["data.chat_template_kwargs={tokenize: true}"])
    with pytest.raises(ConfigError, match="data.eval_split: set data.eval_split or data.eval_path"):
        load_config(None, ["data.source=file", "data.path=x.jsonl", "data.eval_split=test", "data.eval_path=y.jsonl"])


def test_each_prompt_source_carries_only_its_own_keys():
    from dataclasses import fields

    from rlpipe.config import FileSource, HumanEvalSource, ReasoningGymSource

    gym = load_config(None, ["data.task=chain_sum", "data.size=10"]).data.prompt_source()
    assert gym == ReasoningGymSource("chain_sum", {}, 10)
    file = load_config(None, ["data.source=file", "data.path=rows.jsonl", "data.eval_split=test",
                              "data.task=ignored"]).data.prompt_source()
    assert file == FileSource("rows.jsonl", "train", None, "test", None)
    assert {f.name for f in fields(FileSource)}.isdisjoint({"task", "task_args", "size"})
    assert load_config(None, ["data.source=humaneval"]).data.prompt_source() == HumanEvalSource()


def test_reward_files_resolve_from_the_recipes_folder_then_the_working_directory(tmp_path, monkeypatch):
    recipes, elsewhere = tmp_path / "recipes", tmp_path / "elsewhere"
    (recipes / "scoring").mkdir(parents=True)
    elsewhere.mkdir()
    (recipes / "scoring" / "mine.py").write_text("def fn(**kwargs): ...\n")
    (elsewhere / "theirs.py").write_text("def compute_score(solution_str, ground_truth): ...\n")
    recipe = recipes / "run.yaml"
    recipe.write_text(yaml.safe_dump({"reward": {"functions": [
        {"name": "scoring/mine.py:fn"},
        {"name": "verl", "kwargs": {"function": "theirs.py:compute_score", "fixed_data_source": "x"}},
        {"name": "rlpipe.rewards.math:numeric_answer"},
    ]}}))
    monkeypatch.chdir(elsewhere)
    functions = load_config(recipe).reward.functions
    assert [f.name for f in functions] == [
        f"{recipes / 'scoring' / 'mine.py'}:fn", "verl", "rlpipe.rewards.math:numeric_answer"]
    assert functions[1].kwargs == {"function": f"{elsewhere / 'theirs.py'}:compute_score", "fixed_data_source": "x"}


def test_a_missing_reward_file_names_its_key_and_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as raised:
        load_config(None, ['reward.functions=[{name: "nowhere/r.py:fn"}]'])
    assert str(raised.value) == f"reward.functions[0].name: file nowhere/r.py not found (looked in {tmp_path / 'nowhere'})"


def test_auto_experts_are_the_pallas_kernel_in_a_compiled_tpu_program_and_torch_elsewhere():
    kernels = load_config(None, []).model.kernels
    assert kernels.experts == "auto"
    assert kernels.decided(compiled_for_tpu=True).experts == "pallas"
    assert kernels.decided(compiled_for_tpu=False).experts == "torch"
    named = load_config(None, ["model.kernels.experts=loop"]).model.kernels
    assert named.decided(compiled_for_tpu=True) is named


def test_every_shipped_recipe_compiled_for_tpu_runs_experts_a_tpu_program_holds():
    """Every recipe loads, and where it compiles its learner step for TorchTPU its mixture-of-experts layers (if
    any) run TorchTPU's ragged_dot, never the torch reference, whose host-side split such a program cannot run."""
    compiled = {}
    for recipe in sorted(DEFAULT_RECIPE.parent.glob("*.yaml")):
        cfg = load_config(recipe)
        if cfg.learner.device == "tpu" and cfg.learner.graph:
            compiled[recipe.name] = cfg.model.kernels.decided(compiled_for_tpu=True).experts
    assert compiled["qwen3-30b-a3b-v6e.yaml"] == "pallas"
    assert set(compiled.values()) == {"pallas"}, compiled
