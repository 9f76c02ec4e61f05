"""rlpipe's engine side against the installed vLLM on TorchTPU (vllm-torchtpu): the platform is recognised, rlpipe's
worker extension fits its worker, and a weight update through rlpipe's reload writes the new weights into the model
vLLM builds there — vLLM's own Qwen3 and Llama code with vllm-torchtpu's linear layers, which keep their weights
transposed — run on this host's CPU. What needs a chip (the model on `tpu` tensors, a whole engine) is not run."""

from __future__ import annotations

import ast
import inspect
import socket
import types

import pytest
import torch

from rlpipe.rollout.vllm_worker import TORCHTPU_TRANSPOSED_MARK, WeightWriter, vllm_platform


def test_the_out_of_tree_tpu_platform_is_recognised():
    from vllm.platforms import current_platform

    assert type(current_platform).__module__.startswith("vllm_torchtpu.")
    assert current_platform.is_tpu() is False  # what rlpipe once keyed on: vLLM's JAX TPU platform only
    assert vllm_platform() == "torchtpu"


def test_the_worker_extension_fits_the_tpu_worker_and_reaches_the_runners_reload():
    from vllm_torchtpu.runner.tpu_runner import TPUModelRunner
    from vllm_torchtpu.worker.tpu_worker import TPUWorker

    # vLLM appends the extension to the worker's bases and refuses a name both define.
    ours = {name for name in vars(WeightWriter) if not name.startswith("__")}
    assert not ours & set(dir(TPUWorker))
    assert not hasattr(TPUWorker, "reload_weights")  # hence the runner's, reached through `self.model_runner`
    parameters = inspect.signature(TPUModelRunner.reload_weights).parameters
    assert {"weights_iterator", "is_checkpoint_format"} <= set(parameters)
    assert hasattr(TPUModelRunner, "get_model")  # `self.model_runner` is one: tests/tpu_contract/api_uses.py


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_distributed(tpu_device_name):
    """vLLM's (one-process) model-parallel groups, which its layers ask for when built."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", backend="gloo")
        ensure_model_parallel_initialized(1, 1)


def _tpu_model(model_path: str, **engine_args):
    """vLLM's model for `model_path` with the TPU runner's quantization config (its linear method), on the CPU."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_torchtpu.layers.adapter.quantization import get_tpu_quantization_config

    config = EngineArgs(model=model_path, skip_tokenizer_init=True, max_model_len=128, enforce_eager=True,
                        load_format="dummy", dtype="bfloat16", **engine_args).create_engine_config()
    config.quant_config = get_tpu_quantization_config(config)  # as TPUModelRunner does before loading
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
        return initialize_model(vllm_config=config), config


def _random_weights(model_path: str, seed: int) -> dict[str, torch.Tensor]:
    """Weights under Hugging Face names (what rlpipe's learner sends), random, in bfloat16."""
    from rlpipe.models import load_model

    model = load_model(model_path)
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(value.shape, generator=generator).to(torch.bfloat16)
            for name, value in model.state_dict().items()}


def _runner(model, config):
    """The TPU model runner's own `reload_weights`, bound to the little of a runner it reads."""
    from vllm_torchtpu.runner.tpu_runner import TPUModelRunner

    shell = types.SimpleNamespace(
        get_model=lambda: model, lora_config=None, model_config=config.model_config, load_config=config.load_config,
        reset_lora_state=lambda: None, reset_encoder_cache=lambda: None, reset_mm_cache=lambda: None,
    )
    shell.reload_weights = types.MethodType(TPUModelRunner.reload_weights, shell)
    return shell


def _expected(weights: dict[str, torch.Tensor], layer: str) -> dict[str, torch.Tensor]:
    """vllm-torchtpu's kernel layout of one decoder layer: fused projections, transposed to [in, out]."""
    def w(name):
        return weights[f"{layer}.{name}.weight"]

    return {
        "self_attn.qkv_proj": torch.cat([w("self_attn.q_proj"), w("self_attn.k_proj"), w("self_attn.v_proj")]).T,
        "self_attn.o_proj": w("self_attn.o_proj").T,
        "mlp.gate_up_proj": torch.cat([w("mlp.gate_proj"), w("mlp.up_proj")]).T,
        "mlp.down_proj": w("mlp.down_proj").T,
    }


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_a_weight_update_lands_transposed_in_the_tpu_linear_layers(tmp_path, kind, vllm_distributed):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from rlpipe.bench.tiny_model import build_tiny_model

    model_path = build_tiny_model(tmp_path / kind, kind)
    model, config = _tpu_model(model_path)
    first, second = _random_weights(model_path, 1), _random_weights(model_path, 2)
    with set_current_vllm_config(config):
        model.load_weights(list(first.items()))
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    layer = model.model.layers[0]
    assert getattr(layer.self_attn.qkv_proj, TORCHTPU_TRANSPOSED_MARK)  # the layout the update must honour
    before = layer.self_attn.qkv_proj.weight.data_ptr()

    worker = types.SimpleNamespace(model_runner=_runner(model, config))
    with set_current_vllm_config(config):
        assert WeightWriter._reload_on_torchtpu(worker, list(second.items())) == len(second)
    for index, decoder in enumerate(model.model.layers):
        for name, value in _expected(second, f"model.layers.{index}").items():
            torch.testing.assert_close(decoder.get_submodule(name).weight, value, rtol=0, atol=0), name
    torch.testing.assert_close(model.model.embed_tokens.weight, second["model.embed_tokens.weight"], rtol=0, atol=0)
    assert layer.self_attn.qkv_proj.weight.data_ptr() == before  # written in place: compiled graphs see it
    assert getattr(layer.self_attn.qkv_proj, TORCHTPU_TRANSPOSED_MARK)


def test_vllms_own_reload_alone_fails_on_the_transposed_layers(tmp_path, vllm_distributed):
    """Why rlpipe clears vllm-torchtpu's mark first: the runner's reload by itself cannot write these layers."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from rlpipe.bench.tiny_model import build_tiny_model

    model_path = build_tiny_model(tmp_path / "qwen3", "qwen3")
    model, config = _tpu_model(model_path)
    first, second = _random_weights(model_path, 1), _random_weights(model_path, 2)
    with set_current_vllm_config(config):
        model.load_weights(list(first.items()))
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
        with pytest.raises(RuntimeError, match="size of tensor"):
            _runner(model, config).reload_weights(weights_iterator=list(second.items()), is_checkpoint_format=True)


def test_a_write_on_torchtpu_waits_for_the_chip_before_its_host_pages_are_released(tmp_path, monkeypatch,
                                                                                   tpu_device_name):
    """The write of a version from the engine's shared host copy, through rlpipe's worker extension and the copy's
    own reader: the chip is synchronised after the runner's reload and before the pages the reload copied from are
    released. TorchTPU's own `torch.tpu.synchronize` refuses callers outside torch and torch_tpu, hence
    torch.accelerator's."""
    from rlpipe.weightsync import hostcopy

    with pytest.raises(RuntimeError, match="internal to TorchTPU.*torch.accelerator.synchronize"):
        torch.tpu.synchronize()
    events: list[str] = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: events.append(f"synchronize {device}"))
    release = hostcopy._Mapping.drop_read_pages
    monkeypatch.setattr(hostcopy._Mapping, "drop_read_pages", lambda self: (events.append("pages released"),
                                                                           release(self)))

    def reload_weights(weights_iterator, is_checkpoint_format):
        assert [name for name, _ in weights_iterator] == ["w"]
        events.append("reload")

    on_chip = types.SimpleNamespace(device=torch.device("tpu"))
    model = types.SimpleNamespace(modules=lambda: [], parameters=lambda: iter([on_chip]))
    worker = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(get_model=lambda: model, reload_weights=reload_weights),
    )
    worker._rlpipe_apply = types.MethodType(WeightWriter._rlpipe_apply, worker)
    worker._reload_on_torchtpu = types.MethodType(WeightWriter._reload_on_torchtpu, worker)
    worker._check_written = types.MethodType(WeightWriter._check_written, worker)
    with hostcopy.HostCopy(directory=str(tmp_path)).publish({"w": torch.ones(4)}) as shared:
        assert WeightWriter.rlpipe_load_weights(worker, shared.message()) == 1
    assert events[:3] == ["reload", "synchronize tpu", "pages released"]


def test_rlpipes_model_builds_in_vllm_on_torchtpu_with_the_configured_kernels(tmp_path, vllm_distributed):
    """`rollout.model_impl: rlpipe` on this platform: the engine's arguments as RolloutEngine builds them, the model
    vLLM builds from them is rlpipe's, and its norms run the kernel `model.kernels.rmsnorm` names (on `tpu` tensors
    the Pallas one goes through TorchTPU's bridge: tests/tpu_contract/test_kernels.py)."""
    from rlpipe.bench.tiny_model import build_tiny_model
    from rlpipe.models.llama import RMSNorm
    from rlpipe.rollout.vllm_model import RlpipeForCausalLM, engine_overrides, register

    register()
    model_path = build_tiny_model(tmp_path / "qwen3", "qwen3")
    model, _ = _tpu_model(model_path, hf_overrides=engine_overrides(rmsnorm="pallas"))
    assert isinstance(model, RlpipeForCausalLM)
    assert {module.impl for module in model.modules() if isinstance(module, RMSNorm)} == {"pallas"}


def test_rlpipes_model_in_vllm_on_torchtpu_makes_its_kernels_ops_before_vllm_compiles_it(tmp_path, vllm_distributed):
    """vLLM on TorchTPU compiles the model, and a compile cannot make a kernel's TorchTPU op (rlpipe/kernels/_jax.py):
    building rlpipe's model there makes every kernel's op first, as the learner does before its step."""
    from rlpipe.bench.tiny_model import build_tiny_model
    from rlpipe.kernels import _jax
    from rlpipe.rollout.vllm_model import engine_overrides, register

    register()
    model_path = build_tiny_model(tmp_path / "qwen3", "qwen3")
    _jax._TORCHTPU_OPS.clear()
    _tpu_model(model_path, hf_overrides=engine_overrides(rmsnorm="pallas"))
    assert _jax._KERNELS and set(_jax._KERNELS) <= set(_jax._TORCHTPU_OPS)


@pytest.mark.parametrize(
    "setting, message",
    [({"dtype": "float32"}, "rollout.dtype: vLLM on TorchTPU computes in bfloat16 only"),
     ({"temperature": 0.7}, "rollout.temperature: vLLM on TorchTPU reports log-probs before temperature"),
     ({"probe": "replay"}, "sync.probe: replay needs log-probs of a given sequence")],
)
def test_an_engine_refuses_what_this_platform_would_change_silently(setting, message, tmp_path):
    """The platform's config check turns any dtype into bfloat16 (test_the_platform_computes_in_bfloat16_whatever_it_is_given),
    and its runner reports log-probs before temperature (test_the_runner_reports_log_probs_before_temperature)."""
    from rlpipe.bench.tiny_model import build_tiny_model
    from rlpipe.config import RolloutConfig, SyncConfig
    from rlpipe.rollout.engine import RolloutEngine

    model = build_tiny_model(tmp_path / "qwen3", "qwen3")
    with pytest.raises(RuntimeError, match=message):
        sync = SyncConfig(probe=setting.pop("probe", "auto"))
        RolloutEngine(model, RolloutConfig(**{"dtype": "bfloat16", **setting}), 0, sync=sync)


def test_the_platform_computes_in_bfloat16_whatever_it_is_given(tmp_path, tpu_device_name):
    """An engine config asking for float32 comes out of the platform's own check in bfloat16: why a TPU rollout's
    dtype must be bfloat16 (the probe's tolerance is chosen for the dtype the engine computes in)."""
    from vllm.engine.arg_utils import EngineArgs

    from rlpipe.bench.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "qwen3", "qwen3")
    for asked in ("float32", "bfloat16"):
        config = EngineArgs(model=str(model), skip_tokenizer_init=True, max_model_len=128, load_format="dummy",
                            dtype=asked).create_engine_config()
        assert config.model_config.dtype == torch.bfloat16, asked


def test_the_platform_takes_the_decoded_probe_and_returns_no_prompt_logprobs():
    """Why engines here check each sync by decoding: the runner fills no prompt log-probs. The greedy request the
    decoded probe makes passes the platform's own request check (which refuses per-request seeds)."""
    from vllm import SamplingParams
    from vllm.platforms import current_platform
    from vllm_torchtpu.runner import tpu_runner

    from rlpipe.rollout.engine import decoding_params

    # Every output the runner builds gives each request None for its prompt log-probs.
    outputs = [node for node in ast.walk(ast.parse(inspect.getsource(tpu_runner)))
               if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ModelRunnerOutput"]
    assert outputs
    for output in outputs:
        (prompt,) = [keyword.value for keyword in output.keywords if keyword.arg == "prompt_logprobs_dict"]
        assert isinstance(prompt, ast.DictComp) and isinstance(prompt.value, ast.Constant)
        assert prompt.value.value is None
    current_platform.validate_request(None, decoding_params())
    with pytest.raises(ValueError, match="per-request seed"):
        current_platform.validate_request(None, SamplingParams(seed=1))


def _calls(function: ast.AST, method: str) -> list[ast.Call]:
    return [node for node in ast.walk(function) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == method]


def test_the_runner_reports_log_probs_before_temperature():
    """Why rollout.temperature must be 1.0 on TorchTPU: the runner samples from tempered logits but reports the
    sampled tokens' log-probs of the logits as the model gave them. Its sampler and gatherer run here on CPU tensors
    (eagerly: TorchTPU compiles them on a chip), and every step that samples hands both the same logits."""
    from vllm_torchtpu.runner.tpu_runner import TPUModelRunner

    runner = object.__new__(TPUModelRunner)
    runner.model_config = types.SimpleNamespace(max_logprobs=0)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=generator)
    given = logits.clone()
    temperature = 0.5
    with torch.compiler.set_stance("force_eager"):
        sampled = runner.sample_from_logits(
            logits, torch.full((3, 1), temperature), torch.rand(3, 50, generator=generator),
            torch.full((3, 1), 50), torch.ones(3, 1),
        )
        reported = runner.gather_logprobs(logits, sampled).logprobs
    assert torch.equal(logits, given)  # sampling left the logits as they were
    assert torch.allclose(reported, torch.log_softmax(logits, -1).gather(-1, sampled))
    assert not torch.allclose(reported, torch.log_softmax(logits / temperature, -1).gather(-1, sampled))
    steps = 0  # the runner's functions that sample and report log-probs
    for function in ast.walk(ast.parse(inspect.getsource(TPUModelRunner))):
        if not isinstance(function, ast.FunctionDef) or not _calls(function, "gather_logprobs"):
            continue
        samples = _calls(function, "sample_from_logits_func")
        steps += bool(samples)
        handed = {ast.dump(call.args[0]) for call in samples + _calls(function, "gather_logprobs")}
        assert len(handed) == 1, function.name
    assert steps
