"""Every function, method, attribute and keyword argument rlpipe's code uses from torch_tpu, vLLM (as the `tpu` extra
installs it, with vllm-torchtpu) and jax exists in the installed packages and takes the arguments rlpipe passes
(tests/tpu_contract/api_uses.py reads the uses from rlpipe's source and checks them against the real objects)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.tpu_contract.api_uses import collect, check

ROOT = Path(__file__).resolve().parents[2]

# Uses the checks find missing on this platform, each on a path vLLM for TorchTPU never takes.
NOT_ON_THIS_PLATFORM = {
    "TPUWorker.reload_weights": "rlpipe/rollout/vllm_worker.py's reload on other platforms' workers: `rlpipe_load_weights` "
    "returns through `_reload_on_torchtpu` (the runner's reload) first on vLLM for TorchTPU",
    "vllm.lora.layers.classifier.ClassificationHeadWithLoRA": "rlpipe/rollout/vllm_worker.py's direct write of LoRA adapters: "
    "on TorchTPU `sync.lora` sends merged weights (rlpipe/weightsync/form.py), so no engine there takes adapters",
}


@pytest.fixture(scope="module")
def worker_class(tmp_path_factory, tpu_device_name) -> str:
    """The worker class vLLM's engine config names on this platform (vllm-torchtpu sets it)."""
    from vllm.engine.arg_utils import EngineArgs

    from rlpipe.bench.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("model") / "qwen3", "qwen3")
    config = EngineArgs(model=model, skip_tokenizer_init=True, max_model_len=128, enforce_eager=True,
                        load_format="dummy", dtype="bfloat16").create_engine_config()
    return config.parallel_config.worker_cls


def test_every_use_of_the_tpu_packages_holds_against_the_installed_ones(worker_class):
    uses = collect(ROOT, {"WeightWriter": worker_class})
    failures = {name: why for name, use in uses.items() if (why := check(use))}
    # A worker's method by its name on the worker class, anything else by its full path.
    expected = {name if name.startswith("vllm.") else f"{worker_class.rpartition('.')[0]}.{name}"
                for name in NOT_ON_THIS_PLATFORM}
    assert set(failures) == expected, failures
    # The TPU path's own entry points are among what was checked.
    assert {
        "torch.tpu.pallas.jax_op",
        f"{worker_class}.model_runner.reload_weights",
        "vllm.platforms.current_platform.is_out_of_tree",
        "vllm.LLM",
        "jax.experimental.pallas.pallas_call",
        "torch.tpu.ops.splash_sdpa",
        "torch.tpu.ops.ragged_dot",
    } <= set(uses)
    calls = sum(len(use.calls) for use in uses.values())
    print(f"{len(uses)} uses ({calls} calls bound against signatures), {len(failures)} not on this platform")


def test_the_checks_catch_a_missing_name_a_wrong_keyword_and_a_worker_method_that_is_not_there(tmp_path, worker_class):
    package = tmp_path / "rlpipe"
    package.mkdir()
    (package / "uses.py").write_text(textwrap.dedent("""
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform


        def generate():
            llm = LLM(model="m", worker_extension_cls="x.Receiver", not_an_engine_arg=1)
            llm.generate([], SamplingParams(temperature=1.0, not_a_sampling_param=2), use_tqdm=False)
            llm.collective_rpc("start_weight_update")
            return current_platform.is_tpu_v9()


        def kernel():
            jax, jnp, pl = jax_modules()
            return pl.pallas_call(None, out_shape=None, interpreted=True), jnp.zeros((1,)), jax.lax.rsqrt


        class Receiver:
            def apply(self):
                return self.model_runner.state, self.model_runner.get_model()
    """))
    uses = collect(tmp_path, {"Receiver": worker_class})
    failures = {name for name, use in uses.items() if check(use)}
    worker = worker_class
    assert failures == {
        "vllm.LLM",  # not_an_engine_arg
        "vllm.SamplingParams",  # not_a_sampling_param
        f"{worker}.start_weight_update",
        "vllm.platforms.current_platform.is_tpu_v9",
        "jax.experimental.pallas.pallas_call",  # interpreted=
        f"{worker}.model_runner.state",
    }
    assert {"vllm.LLM.generate", "jax.numpy.zeros", "jax.lax.rsqrt", f"{worker}.model_runner.get_model"} <= set(uses)
