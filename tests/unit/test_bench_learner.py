"""`rlpipe bench learner` settings: the MoE shape and its command line (the timings themselves are not tested)."""

import pytest

from rlpipe.bench.learner import LearnerBenchShape, _bench_config
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
    from rlpipe.bench.learner import _batch, _mode_settings

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


# Parameters of each Qwen3 preset's config.json shape, counted by transformers' Qwen3 as by rlpipe's model.
QWEN3_PARAMETERS = {"qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976}


@pytest.mark.parametrize("preset", QWEN3_PARAMETERS)
def test_qwen3_presets_have_the_released_models_shape_and_flop_count(preset):
    import torch
    import transformers

    from rlpipe.bench.learner import PRESETS

    shape = LearnerBenchShape(**PRESETS[preset])
    config = shape.hf_config()
    assert (config["model_type"], config["head_dim"], config["tie_word_embeddings"]) == ("qwen3", 128, True)
    with torch.device("meta"):
        model = build_model(config)
        reference = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
        )
    params = sum(p.numel() for p in model.parameters())
    assert params == sum(p.numel() for p in reference.parameters()) == QWEN3_PARAMETERS[preset]
    # Every matrix is one matmul a token (the tied embedding once, as the output projection); norms are no matmul.
    matmul_weights = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    attention = 2 * shape.layers * shape.heads * shape.head_dim * shape.seq
    assert shape.flops_per_token() == 6 * matmul_weights + 6 * attention


def test_cuda_runs_in_bf16_mixed_precision_and_cpu_as_before(tmp_path):
    shape = LearnerBenchShape()
    cuda = _bench_config(str(tmp_path), shape, 1, True, "cuda")
    assert (cuda.learner.device, cuda.model.dtype, cuda.learner.param_dtype) == ("cuda", "float32", "bfloat16")
    cpu = _bench_config(str(tmp_path), shape, 1, True)
    assert (cpu.learner.device, cpu.model.dtype, cpu.learner.param_dtype) == ("cpu", "float32", None)


def test_timed_steps_drain_the_gpu_before_every_clock_read(monkeypatch):
    from types import SimpleNamespace

    import torch

    import rlpipe.bench.learner as bench_learner

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    clock = iter(range(100))
    monkeypatch.setattr(bench_learner.time, "perf_counter", lambda: events.append("clock") or next(clock))
    learner = SimpleNamespace(
        engine=SimpleNamespace(device=torch.device("cuda", 0)), train_step=lambda batch: events.append("step")
    )
    bench_learner._timed_steps(learner, None, 2)
    assert events == ["sync", "clock", "step", "sync", "clock", "clock", "step", "step", "sync", "clock"]


def test_cli_runs_cuda_on_one_rank_with_the_preset(monkeypatch, capsys):
    import torch

    import rlpipe.bench.learner as bench_learner

    calls = []
    monkeypatch.setattr(bench_learner, "bench_learner", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["bench", "learner", "--device", "cuda", "--preset", "qwen3-0.6b", "--seq", "512"]) == 0
    (shape, modes, _out), options = calls[0]
    assert (shape.layers, shape.vocab, shape.head_dim, shape.seq, shape.batch) == (28, 151936, 128, 512, 8)
    assert modes == ["eager", "graph"] and options == {"rounds": 1, "device": "cuda"}
    assert main(["bench", "learner"]) == 0  # cpu: the shape and modes it always had
    (shape, modes, _out), options = calls[1]
    assert shape == LearnerBenchShape() and modes == ["eager", "graph", "eager-m2", "graph-m2"]
    assert options["device"] == "cpu"
    for argv, message in (
        (["--device", "cuda", "--modes", "eager,graph-m2"], "graph-m2: on cuda the modes run on one rank"),
        (["--device", "cuda", "--rounds", "2"], "--rounds: on cuda"),
        (["--preset", "qwen3-7b"], "--preset: unknown 'qwen3-7b'"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "learner", *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        main(["bench", "learner", "--device", "cuda"])
    assert "no CUDA GPU is visible to torch" in capsys.readouterr().err
    assert len(calls) == 2
