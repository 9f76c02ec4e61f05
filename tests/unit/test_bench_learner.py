"""`rlpipe bench learner` settings: the MoE shape and its command line (the timings themselves are not tested)."""

import pytest

from rlpipe.bench import LearnerBenchShape, _bench_config
from rlpipe.cli import main
from rlpipe.models import build_model


def test_moe_shape_builds_a_qwen3_moe_and_counts_only_the_visited_experts():
    shape = LearnerBenchShape(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, experts=8, top_k=2, expert_intermediate=16)
    model = build_model(shape.hf_config())
    assert model.config.moe_layers == (0, 1) and model.config.experts_per_token == 2
    wider = LearnerBenchShape(**{**shape.__dict__, "top_k": 4})
    # Two more experts a token, each 3 matmuls of hidden x expert_intermediate, in each of 2 layers, 6 FLOPs a weight.
    assert wider.flops_per_token() - shape.flops_per_token() == 6 * 2 * 2 * 3 * 32 * 16
    assert LearnerBenchShape(**{**shape.__dict__, "experts": 0}).hf_config()["model_type"] == "llama"


def test_mode_suffix_picks_the_experts_implementation(tmp_path):
    shape = LearnerBenchShape(experts=4)
    assert _bench_config(str(tmp_path), shape, 1, False, experts="loop").model.kernels.experts == "loop"
    assert _bench_config(str(tmp_path), shape, 1, True).model.kernels.experts == "torch"


def test_cli_rejects_more_experts_per_token_than_experts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "learner", "--experts", "4", "--top-k", "5"])
    assert exit_info.value.code == 2
    assert "--top-k" in capsys.readouterr().err


def test_group_shaped_rows_share_their_prompt_and_eager_unshared_turns_sharing_off(tmp_path):
    from rlpipe.bench import _batch, _mode_settings

    shape = LearnerBenchShape(seq=8, batch=8, vocab=64, group=4)
    batch = _batch(shape)
    prompts = batch.input_ids[:, :4]
    assert (prompts[:4] == prompts[0]).all() and (prompts[4:] == prompts[4]).all() and (prompts[0] != prompts[4]).any()
    assert (batch.input_ids[:4, 4:] != batch.input_ids[0, 4:]).any(dim=1)[1:].all()  # completions differ
    config = _bench_config(str(tmp_path), shape, 1, False)
    assert config.rollout.group_size == 4 and config.train.prompts_per_step == 2 and config.learner.share_prompts
    assert _mode_settings("eager-unshared") == (False, "torch", False)
    assert _mode_settings("graph") == (True, "torch", True) and _mode_settings("eager+loop") == (False, "loop", True)
    assert not _bench_config(str(tmp_path), shape, 1, False, share_prompts=False).learner.share_prompts


def test_cli_rejects_a_group_size_that_does_not_divide_the_batch(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "learner", "--batch", "8", "--group-size", "3"])
    assert exit_info.value.code == 2
    assert "--group-size" in capsys.readouterr().err
