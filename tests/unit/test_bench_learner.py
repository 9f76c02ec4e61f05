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
