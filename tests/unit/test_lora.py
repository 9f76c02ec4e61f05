"""LoRA adapters on the learner (rlpipe/training/lora.py): a frozen base, adapters alone trained and in the optimizer, the
adapters alone or merged weights for the engines (sync.lora), the adapter folders an engine writes, PEFT's adapter
format on export, checkpoints of adapters alone with exact resume, and two sharded ranks equal to one."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from rlpipe.training import checkpoint
from rlpipe.training.checkpoint import CheckpointError
from rlpipe.cli import main
from rlpipe.config import ConfigError, load_config
from rlpipe.training.learner import Learner, combine_rank_metrics
from rlpipe.training.lora import (
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, AdapterFolders, adapter_rows, adapter_shapes_problem, is_adapter_key,
)
from rlpipe.models import load_model, read_hf_config
from rlpipe.parallel.mesh import find_free_port
from rlpipe.training.weight_views import AdapterView, MergedView
from rlpipe.weightsync.form import FULL, Kind, WeightForm, decide_weight_form, weight_form
from rlpipe.weightsync import EngineLayout, Staging, pack_part, plan_sync, shard_rows
from tests.batches import four_samples
from tests.unit.test_learner_group import _batches, _config, _rank
from tests.unit.test_weightsync import KEY
from tests.weights import whole_weights

LORA = ("learner.lora.rank=2", "learner.lora.alpha=4")  # scaling 2
SCALE = 2.0


def _learner(model_path, *extra) -> Learner:
    cfg = _config(model_path, 1, False, *LORA, *extra)
    return Learner.from_config(model_path, cfg, form=weight_form(cfg, model_path))


def _adapters(learner: Learner) -> dict[str, torch.nn.Parameter]:
    return {name: param for name, param in learner.model.named_parameters() if is_adapter_key(name)}


def _randomise_adapters(learner: Learner, seed: int = 1) -> None:
    """Non-zero adapters (a fresh B is zero, which would make every comparison below trivially true)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in _adapters(learner).values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def test_lora_keys_have_pefts_defaults_all_linear_targets_and_one_line_refusals():
    lora = load_config(None, ["learner.lora.rank=1"]).learner.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (1, 8.0, 0.0, ["all-linear"])
    assert load_config(None, []).learner.lora is None  # full fine-tuning
    assert load_config(None, ["learner.lora.target_modules=[q_proj,v_proj]"]).learner.lora.target_modules == [
        "q_proj", "v_proj"
    ]
    for bad, message in [
        ("learner.lora.rank=0", "learner.lora.rank: must be >= 1"),
        ("learner.lora.dropout=1", "learner.lora.dropout"),
        ("learner.lora.target_modules=[all-linear,q_proj]", "learner.lora.target_modules"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["learner.lora.rank=1", bad])


@pytest.mark.heavy
def test_the_base_is_frozen_and_only_the_adapters_train_and_hold_optimizer_state(tiny_qwen3):
    learner = _learner(tiny_qwen3)
    start = load_model(tiny_qwen3).state_dict()
    adapters = _adapters(learner)
    # Every linear layer of every decoder layer (attention and MLP), not the output layer.
    modules = {name.rpartition(".lora_")[0].split(".")[-1] for name in adapters}
    assert modules == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not any("lm_head" in name or "embed" in name for name in adapters)
    step = learner.engine.ready()
    assert {id(p) for p in step.params} == {id(p) for p in adapters.values()}
    assert len(step.optimizer.exp_avg) == len(step.optimizer.exp_avg_sq) == len(adapters)
    assert all(not torch.count_nonzero(p) for name, p in adapters.items() if name.endswith("lora_B.weight"))

    for batch in _batches()[:2]:
        learner.train_step(batch)
    for name, param in learner.model.named_parameters():
        if not is_adapter_key(name):
            assert not param.requires_grad and param.grad is None, name
            assert torch.equal(param, start[name]), name  # the base never moves
    assert all(torch.count_nonzero(p) for p in adapters.values())  # B left zero, A moved once B did

    # Gradients reach every adapter (A's only through a non-zero B) and no base weight.
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    loss = learner.model(ids).logsumexp(-1).sum()
    grads = torch.autograd.grad(loss, list(adapters.values()))
    assert all(torch.count_nonzero(g) for g in grads)


def test_under_lora_the_kl_reference_is_the_base_with_its_adapters_off_and_no_copy_is_held(tiny_qwen3):
    learner = _learner(tiny_qwen3, "algo.kl_beta=0.1")
    assert learner.reference is None and learner.engine.frozen == []
    first = learner.train_step(four_samples())
    assert float(first.stats.kl) == pytest.approx(0.0, abs=1e-7)  # B starts at zero: the policy is the reference
    assert float(learner.train_step(four_samples(seed=1)).stats.kl) > 0
    # However far the adapters moved, the reference is the starting model's log-probs, bit for bit, and the adapters
    # are on again after it.
    _randomise_adapters(learner)
    start = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, 1, False))
    batch = four_samples(seed=2)
    reference = learner._reference_logprobs(batch)
    assert torch.equal(reference, start.engine.logprobs(batch, start.model))
    assert not torch.equal(learner.engine.logprobs(batch, learner.model), reference)


def test_sync_lora_sends_adapters_where_the_engines_take_them_else_merged_weights_with_the_reason(
    tiny_qwen3, tiny_qwen3_moe
):
    cfg = load_config(None, ["learner.lora.rank=1"])
    assert decide_weight_form(cfg) == weight_form(cfg, tiny_qwen3) == WeightForm(Kind.ADAPTERS, cfg.learner.lora)
    assert weight_form(cfg, tiny_qwen3).lora.rank == 1  # the adapters' settings travel with the form
    form = weight_form(cfg, tiny_qwen3_moe)
    assert form.kind is Kind.MERGED and "mixture-of-experts" in form.why_merged
    assert decide_weight_form(load_config(None, [])) == FULL  # full fine-tuning: whole weights
    for extra, reason in [
        (["sync.lora=merged"], "sync.lora: merged"),
        (["rollout.model_impl=rlpipe"], "rollout.model_impl: rlpipe"),
        (["learner.lora.rank=600"], "above the largest adapter rank vLLM takes"),
        (["learner.lora.target_modules=[q_proj,lm_head]"], "lm_head"),
    ]:
        form = decide_weight_form(load_config(None, ["learner.lora.rank=1", *extra]))
        assert form.kind is Kind.MERGED and reason in form.why_merged, extra
    for bad, message in [
        (["sync.lora=adapters"], "sync.lora: adapters needs LoRA adapters"),
        (["learner.lora.rank=1", "sync.lora=adapters", "rollout.model_impl=rlpipe"],
         "sync.lora: adapters is not possible here: rlpipe's model in vLLM"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, bad)


def test_an_adapter_sync_sends_the_adapters_alone_and_two_ranks_send_each_row_once(tiny_qwen3):
    """The sync state is the adapters under their state-dict names. Over two ranks each sends the rows of B it holds
    and its share of A's rows (A is whole on every rank): through the real plan, packing and staging, the engine
    assembles exactly the adapters."""
    learner = _learner(tiny_qwen3)
    assert isinstance(learner.engine.weights, AdapterView)
    _randomise_adapters(learner)
    adapters = {name: p.detach().clone() for name, p in _adapters(learner).items()}
    shapes = learner.weight_shapes()
    assert shapes == {name: tuple(value.shape) for name, value in adapters.items()}
    sent = learner.local_weights()
    assert sent.keys() == adapters.keys()
    for name, value in sent.items():
        assert torch.equal(value, adapters[name]), name

    layout = EngineLayout.from_hf_config(read_hf_config(tiny_qwen3), 1, "float32")
    plan = plan_sync(shapes, 2, layout, 4096)
    assert len(plan.buckets) > 1
    staging = Staging(plan, 1, KEY)
    for rank in range(2):
        held = {  # as SimpleFSDP holds them: A replicated, B's rows sharded
            name: value if ".lora_A." in name else value[slice(*shard_rows(value.shape[0], rank, 2))]
            for name, value in adapters.items()
        }
        local = adapter_rows(held, shapes, rank, 2)
        for name, value in local.items():
            start, stop = shard_rows(shapes[name][0], rank, 2)
            assert torch.equal(value, adapters[name][start:stop]), name
        for bucket in plan.buckets:
            if bucket.part_bytes(rank):
                buffer = np.empty(bucket.part_bytes(rank), dtype=np.uint8)
                digest = pack_part(bucket, rank, local, plan.torch_dtype, buffer, version=1, key=KEY)
                staging.add(bucket.index, rank, buffer, digest)
    received = staging.complete()
    assert received.keys() == adapters.keys()
    for name, value in received.items():
        assert torch.equal(value, adapters[name]), name


def test_an_engine_writes_each_version_into_the_other_of_two_adapter_folders_that_peft_loads(tiny_qwen3, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    learner = _learner(tiny_qwen3)
    folders = AdapterFolders(tmp_path / "adapters", learner.engine.form.lora, tiny_qwen3)
    versions = []
    for seed in (1, 2, 3):
        _randomise_adapters(learner, seed)
        versions.append({name: p.detach().clone() for name, p in _adapters(learner).items()})
    first, second = folders.write(versions[0]), folders.write(versions[1])
    assert first != second and (first / ADAPTER_WEIGHTS).exists()  # the previous version stays for a rollback
    assert folders.write(versions[2]) == first  # two versions old: replaced
    ids = torch.tensor([[5, 9, 17, 33, 2, 40, 41]])
    with torch.no_grad():
        ours = learner.model(ids)  # the third version's adapters
        hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
        torch.testing.assert_close(peft.PeftModel.from_pretrained(hf, str(first)).eval()(ids).logits, ours,
                                   atol=1e-5, rtol=0)
    folders.clear()  # once the engine serves a version written past the folders, neither may be loaded again
    assert not first.exists() and not second.exists() and (tmp_path / "adapters").is_dir()
    folders.remove()
    assert not (tmp_path / "adapters").exists()


def _lora_slots(worker) -> dict[str, torch.Tensor]:
    """Every LoRA buffer of a vLLM worker (run inside it through `collective_rpc`), copied: each slice's stacked A
    and B of every LoRA layer, every slot, the rank's padding included."""
    manager = worker.model_runner.lora_manager._adapter_manager
    return {f"{name}.{which}{index}": stacked.clone()
            for name, module in manager.modules.items() if hasattr(module, "lora_a_stacked")
            for which in ("a", "b") for index, stacked in enumerate(getattr(module, f"lora_{which}_stacked"))}


@pytest.mark.xdist_group("engines")  # an in-process vLLM engine pins its process's threads: beside the other engines
@pytest.mark.heavy
def test_an_engine_writes_later_adapter_versions_into_vllms_buffers_bit_for_bit_as_vllms_own_load(tiny_qwen3,
                                                                                                    tmp_path):
    """The first version goes through vLLM's add_lora (a folder); a later one is written straight into the LoRA
    buffers, and holds there exactly what vLLM's own load of the same adapters leaves (rank 2 in vLLM's rank 8,
    scaling 2 folded into B, q/k/v and gate/up packed), then a corrupt write is caught by the read-back, and adapters
    the loaded slot cannot take go through a folder again."""
    from vllm.lora.request import LoRARequest

    from rlpipe.config import RolloutConfig
    from rlpipe.training.lora import save_adapter
    from rlpipe.rollout.engine import POLICY_ADAPTER, RolloutEngine
    from rlpipe.weightsync import SyncError

    learner = _learner(tiny_qwen3)
    form = learner.engine.form
    versions = []
    for seed in (1, 2, 3):
        _randomise_adapters(learner, seed)
        versions.append({name: p.detach().clone() for name, p in _adapters(learner).items()})
    sent = {name: value.clone() for name, value in versions[1].items()}
    engine = RolloutEngine(tiny_qwen3, RolloutConfig(max_model_len=128, max_tokens=4), 0, form=form,
                           progress_bars=False)
    try:
        folders = engine.writer.folders.root
        engine.writer.write(versions[0])
        assert (folders / "a").is_dir()  # the first version: vLLM loaded it from a folder
        first = engine.llm.collective_rpc(_lora_slots)[0]
        engine.writer.write(versions[1])
        assert not (folders / "a").exists() and not (folders / "b").exists()  # written directly; no stale folder
        direct = engine.llm.collective_rpc(_lora_slots)[0]
        assert all(torch.equal(value, sent[name]) for name, value in versions[1].items())  # what arrived is unchanged
        name, lora_id = POLICY_ADAPTER
        folder = save_adapter(versions[1], form.lora, tiny_qwen3, tmp_path / "second")
        assert engine.llm.llm_engine.add_lora(LoRARequest(name, lora_id, str(folder), load_inplace=True))
        loaded = engine.llm.collective_rpc(_lora_slots)[0]
        assert direct.keys() == loaded.keys() >= {"model.layers.1.self_attn.qkv_proj.b2", "model.layers.1.mlp.down_proj.b0"}
        for key, value in loaded.items():
            assert torch.equal(direct[key], value), key  # bit for bit, padding and the unused slots included
        assert all(not torch.equal(first[key], direct[key]) for key in loaded if ".layers." in key)

        def corrupt(worker):  # one layer's set_lora doubles its B from now on
            module = worker.model_runner.lora_manager._adapter_manager.modules["model.layers.1.self_attn.o_proj"]
            original = module.set_lora
            module.set_lora = lambda index, a, b: (original(index, a, b), module.lora_b_stacked[0].mul_(2))

        engine.llm.collective_rpc(corrupt)
        with pytest.raises(SyncError, match="LoRA buffers of .* do not hold the adapter"):
            engine.writer.write(versions[2])
        engine.llm.collective_rpc(lambda worker: [m.__dict__.pop("set_lora", None) for m in
                                                  worker.model_runner.lora_manager._adapter_manager.modules.values()])
        fewer = {key: value for key, value in versions[2].items() if ".mlp." not in key}
        engine.writer.write(fewer)  # the slot holds MLP adapters that these lack: vLLM loads them from a folder
        assert (folders / "a").is_dir() or (folders / "b").is_dir()
    finally:
        engine.close()


def test_engines_receive_the_merged_weights_which_give_the_adapted_models_logits(tiny_qwen3):
    learner = _learner(tiny_qwen3, "sync.lora=merged")
    assert type(learner.engine.weights) is MergedView
    _randomise_adapters(learner)
    base = load_model(tiny_qwen3).state_dict()
    adapters = {name: p.detach() for name, p in _adapters(learner).items()}
    shapes = learner.weight_shapes()
    assert shapes == {name: tuple(value.shape) for name, value in base.items()}  # what the sync plans for
    sent = learner.local_weights()
    assert sent.keys() == base.keys()
    for name, value in sent.items():
        module = name.removesuffix(".weight")
        expected = base[name]
        if f"{module}.lora_A.weight" in adapters:
            expected = expected + SCALE * adapters[f"{module}.lora_B.weight"] @ adapters[f"{module}.lora_A.weight"]
        torch.testing.assert_close(value, expected, atol=1e-6, rtol=0)
    plain = load_model(tiny_qwen3)
    plain.load_state_dict(sent)
    ids = torch.tensor([[5, 9, 17, 33, 2, 40, 41]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids), learner.model(ids), atol=1e-5, rtol=0)


def test_export_is_a_peft_adapter_folder_that_peft_loads_with_the_same_logits(tiny_qwen3, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    learner = _learner(tiny_qwen3)
    _randomise_adapters(learner)
    folder = tmp_path / "adapter"
    learner.export(str(folder))
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 2, 4.0)
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert config["target_modules"] == sorted(projections)
    from safetensors import safe_open

    with safe_open(str(folder / ADAPTER_WEIGHTS), "pt") as stored:
        assert set(stored.keys()) == {PEFT_PREFIX + name for name in _adapters(learner)}

    ids = torch.tensor([[5, 9, 17, 33, 2, 40, 41]])
    with torch.no_grad():
        ours = learner.model(ids)
        hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
        peft_model = peft.PeftModel.from_pretrained(hf, str(folder)).eval()
        torch.testing.assert_close(peft_model(ids).logits, ours, atol=1e-5, rtol=0)

        merged = tmp_path / "merged"
        learner.engine.export(str(merged), merge=True)
        hf_merged = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
        torch.testing.assert_close(hf_merged(ids).logits, ours, atol=1e-5, rtol=0)


def _save(learner: Learner, run_dir, step: int):
    partial = checkpoint.begin_save(run_dir, step)
    learner.save_checkpoint(str(partial / checkpoint.LEARNER_STATE))
    cfg = _config(learner.engine.model_path, 1, False, *LORA)
    config = {"model": {"path": learner.engine.model_path, "tokenizer": None}, "learner": cfg.to_dict()["learner"]}
    return checkpoint.finish_save(partial, {"step": step, "config": config}, 3)


def test_a_checkpoint_holds_the_adapters_alone_resumes_exactly_and_exports_as_peft_or_merged(
    tiny_qwen3, tmp_path, capsys
):
    batches = _batches()
    learner = _learner(tiny_qwen3)
    learner.train_step(batches[0])
    saved = _save(learner, tmp_path / "run", 1)
    stored = checkpoint.model_shapes(saved / checkpoint.LEARNER_STATE)
    assert stored and all(map(is_adapter_key, stored))  # no base weight is written
    optimizer_keys = [k for k in checkpoint.read_metadata(saved / checkpoint.LEARNER_STATE).state_dict_metadata
                      if k.startswith("optim.") and k != "optim.step"]
    assert len(optimizer_keys) == 2 * len(stored)
    learner.train_step(batches[1])
    expected = {name: p.detach().clone() for name, p in _adapters(learner).items()}

    resumed = _learner(tiny_qwen3)
    base = {name: tuple(value.shape) for name, value in load_model(tiny_qwen3).state_dict().items()}
    checkpoint.check_fits(saved, base, "the tiny qwen3")
    resumed.load_checkpoint(str(saved / checkpoint.LEARNER_STATE))
    resumed.train_step(batches[1])
    for name, value in _adapters(resumed).items():
        torch.testing.assert_close(value.detach(), expected[name], atol=0, rtol=0)
    checkpoint.check_trains_alike(saved, lora=True)
    with pytest.raises(CheckpointError, match="it holds LoRA adapters; learner.lora must be set to resume from it"):
        checkpoint.check_trains_alike(saved, lora=False)
    wider = {**base, "model.layers.1.mlp.down_proj.weight": (64, 999)}  # another model's
    with pytest.raises(CheckpointError, match="its weights do not fit another model: adapter .*down_proj"):
        checkpoint.check_fits(saved, wider, "another model")

    assert main(["export", str(tmp_path / "run"), str(tmp_path / "adapter")]) == 0
    assert (tmp_path / "adapter" / ADAPTER_CONFIG).exists() and (tmp_path / "adapter" / ADAPTER_WEIGHTS).exists()
    assert main(["export", "--merge", str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    reloaded = _learner(tiny_qwen3)
    reloaded.load_checkpoint(str(saved / checkpoint.LEARNER_STATE))
    exported = load_model(tmp_path / "merged").state_dict()
    for name, value in whole_weights(reloaded).items():
        torch.testing.assert_close(exported[name], value, atol=1e-6, rtol=0)


def test_adapter_shapes_are_checked_against_the_base():
    base = {"q.weight": (8, 4), "norm.weight": (4,)}
    fits = {"q.lora_A.weight": (2, 4), "q.lora_B.weight": (8, 2)}
    assert adapter_shapes_problem(base, fits) is None
    assert "does not fit" in adapter_shapes_problem(base, {**fits, "q.lora_A.weight": (2, 5)})
    on_a_norm = {"norm.lora_A.weight": (2, 4), "norm.lora_B.weight": (4, 2)}
    assert "no linear weight" in adapter_shapes_problem(base, on_a_norm)
    assert "pair up" in adapter_shapes_problem(base, {**fits, "q.lora_B.weight": (8, 3)})


def _one_rank_and_two(model_path: str, graph: bool, timeout_s: float):
    """One eager rank's learner and per-step metrics, and the outputs of two SimpleFSDP ranks (`graph`: the captured
    step) trained on the same batches, all sending merged weights."""
    merged = (*LORA, "sync.lora=merged")
    single = _learner(model_path, "sync.lora=merged")
    single_metrics = [combine_rank_metrics([single.train_step(b)]) for b in _batches()]
    context = mp.get_context("spawn")
    results = context.Queue()
    port = find_free_port()
    procs = [context.Process(target=_rank, args=(r, 2, model_path, port, graph, results, merged)) for r in range(2)]
    for p in procs:
        p.start()
    outputs = [results.get(timeout=timeout_s) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return single, single_metrics, outputs


@pytest.mark.heavy
def test_two_sharded_ranks_train_the_adapters_as_one_rank_does(tiny_qwen3):
    """SimpleFSDP over two ranks: the same losses, and the merged weights each rank sends (its own rows, merged
    without a collective: lora_A is replicated, as the adapter sync's test above takes it) are the single rank's."""
    single, single_metrics, outputs = _one_rank_and_two(tiny_qwen3, graph=False, timeout_s=600)
    local = {rank: shards for *_, rank, shards in outputs}
    full = whole_weights(single)
    assert local[0].keys() == full.keys()
    for name, value in full.items():
        start, stop = shard_rows(value.shape[0], 0, 2)
        together = torch.from_numpy(np.concatenate([local[0][name], local[1][name]]))
        assert local[0][name].shape[0] == stop - start, name
        torch.testing.assert_close(together, value, atol=1e-5, rtol=0)
    for step in range(len(single_metrics)):
        combined = combine_rank_metrics([sums[step] for sums, *_ in outputs])
        for key in ("loss", "kl", "grad_norm"):
            assert abs(combined[key] - single_metrics[step][key]) < 1e-5, (step, key)


def test_the_syncs_merged_weights_are_computed_one_at_a_time_as_they_are_read():
    """The learner hands the sync a view: nothing is merged until a weight is read, and each read merges that weight
    alone, so a rank never holds a merged copy of the model."""
    from rlpipe.training.lora import MergedWeights, merged

    generator = torch.Generator().manual_seed(0)
    state = {"q.weight": torch.randn(4, 3, generator=generator), "q.lora_A.weight": torch.randn(2, 3, generator=generator),
             "q.lora_B.weight": torch.randn(4, 2, generator=generator), "norm.weight": torch.randn(3, generator=generator)}
    read = []

    class Watched(dict):
        def __getitem__(self, name):
            read.append(name)
            return super().__getitem__(name)

        def get(self, name, default=None):
            read.append(name)
            return super().get(name, default)

    view = MergedWeights(Watched(state), 0.5)
    assert list(view) == ["q.weight", "norm.weight"] and len(view) == 2 and read == []
    assert torch.allclose(view["q.weight"], state["q.weight"] + 0.5 * state["q.lora_B.weight"] @ state["q.lora_A.weight"])
    assert set(read) == {"q.weight", "q.lora_A.weight", "q.lora_B.weight"}
    assert "q.lora_A.weight" not in view
    assert {name: t.tolist() for name, t in merged(state, 0.5).items()} == {name: view[name].tolist() for name in view}


def test_adapter_folders_of_engines_whose_process_is_gone_are_removed(tmp_path):
    import subprocess
    import sys

    from rlpipe.training.lora import ADAPTER_FOLDER_PREFIX, adapter_root

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{ADAPTER_FOLDER_PREFIX}{gone.stdout.strip()}-x"
    alive = tmp_path / f"{ADAPTER_FOLDER_PREFIX}1-y"  # process 1 lives as long as the machine
    other = tmp_path / f"{ADAPTER_FOLDER_PREFIX}notapid"
    for folder in (dead, alive, other):
        (folder / "a").mkdir(parents=True)
    root = adapter_root(str(tmp_path))
    assert not dead.exists() and alive.exists() and other.exists()
    assert root.startswith(str(tmp_path / f"{ADAPTER_FOLDER_PREFIX}{os.getpid()}-"))


@pytest.mark.heavy
def test_the_captured_step_trains_the_adapters_as_the_eager_step_does_and_compiles_once(tiny_qwen3):
    """learner.graph with adapters: forward, loss, backward and AdamW of the adapters captured as one graph give the
    eager step's losses, gradient norms and adapters after every step, leave the base as it was, and compile once
    for three steps of one bucket (the adapters' values change between steps, their shapes do not). B starts
    non-zero so that the first step's gradients reach A as well."""
    eager, graph = _learner(tiny_qwen3), _learner(tiny_qwen3, "learner.graph=true")
    for learner in (eager, graph):
        _randomise_adapters(learner)
    base = load_model(tiny_qwen3).state_dict()
    for batch in _batches():
        expected, got = combine_rank_metrics([eager.train_step(batch)]), combine_rank_metrics([graph.train_step(batch)])
        for key in ("loss", "kl", "grad_norm"):
            assert got[key] == pytest.approx(expected[key], abs=1e-5), key
        assert expected["grad_norm"] > 0
        moved = _adapters(eager)
        for name, value in _adapters(graph).items():
            torch.testing.assert_close(value.detach(), moved[name].detach(), atol=1e-5, rtol=0)
    assert got["learner/graph_compiles"] == 1 and got["learner/graph_breaks"] == 0
    for name, param in graph.model.named_parameters():
        if not is_adapter_key(name):
            assert torch.equal(param, base[name]), name


@pytest.mark.slow  # two ranks each compile the sharded step with inductor: minutes on 2 cores; opt-in: -m slow
def test_two_sharded_ranks_capture_the_adapters_step_as_one_eager_rank_trains_it(tiny_qwen3):
    """SimpleFSDP over two ranks with learner.graph: the same losses, KL and gradient norms as one eager rank, the
    same merged weights (so the same adapters on the same base), and one compiled graph for three steps."""
    single, single_metrics, outputs = _one_rank_and_two(tiny_qwen3, graph=True, timeout_s=1200)
    local = {rank: shards for *_, rank, shards in outputs}
    for name, value in whole_weights(single).items():
        together = torch.from_numpy(np.concatenate([local[0][name], local[1][name]]))
        torch.testing.assert_close(together, value, atol=1e-5, rtol=0)
    for step in range(len(single_metrics)):
        combined = combine_rank_metrics([sums[step] for sums, *_ in outputs])
        for key in ("loss", "kl", "grad_norm"):
            assert abs(combined[key] - single_metrics[step][key]) < 1e-5, (step, key)
        assert combined["learner/graph_compiles"] == 1 and combined["learner/graph_breaks"] == 0
