"""A learner rank reads only its own shard of the model from the checkpoint: the bytes allocated while a rank of a
two-rank SimpleFSDP group loads stay near half the model, where loading the whole model (and sharding it after, as
rlpipe once did) allocates all of it. Allocation is measured with glibc's malloc statistics, which every CPU tensor
and every safetensors read goes through, sampled at each torch op."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from rlpipe.config import load_config
from rlpipe.training.learner import Learner
from rlpipe.models import load_model
from rlpipe.parallel.mesh import make_mesh


class _MallocInfo(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallocInfo


def _allocated() -> int:
    """Bytes malloc has handed out and not taken back: arenas' chunks in use plus mmap'd blocks."""
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakAllocated(TorchDispatchMode):
    """The most bytes allocated at once, above what was allocated on entry, sampled after every torch op."""

    def __enter__(self):
        self.base, self.peak = _allocated(), 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, _allocated() - self.base)
        return out


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> str:
    """A Qwen3-MoE checkpoint of ~40 MB in fp32, stored in bf16: large enough that allocator noise is small."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
        tie_word_embeddings=False, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("moe")
    model.save_pretrained(folder)
    return str(folder)


@pytest.mark.heavy
def test_a_rank_allocates_its_shard_not_the_model_while_it_loads(moe_folder):
    cfg = load_config(
        None,
        [f"model.path={moe_folder}", "learner.ranks=2", "train.prompts_per_step=2", "rollout.group_size=2",
         "train.micro_batch_size=2"],
    )
    learner = Learner.from_config(moe_folder, cfg, rank=0, world_size=2)
    engine = learner.engine
    strategy = engine.strategy
    assert all(param.is_meta for param in engine.model.parameters())  # nothing read before the group forms

    def join_fake_group(master_addr: str, master_port: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        strategy.mesh = make_mesh(2, "cpu")

    peaks = []
    load = strategy.load

    def measured_load(model, weights):
        with PeakAllocated() as measure:
            load(model, weights)
        peaks.append(measure.peak)

    strategy.join, strategy.load = join_fake_group, measured_load
    try:
        learner.join_process_group("127.0.0.1", 0)
        local = strategy.local_weights(engine.model)
    finally:
        dist.destroy_process_group()

    full = load_model(moe_folder, dtype=torch.float32).state_dict()
    total = sum(tensor.nbytes for tensor in full.values())
    largest = max(tensor.nbytes for tensor in full.values())
    # Rank 0 holds the first ceil(rows / 2) rows of every parameter: exactly the checkpoint's.
    for name, tensor in full.items():
        assert torch.equal(local[name], tensor[: math.ceil(tensor.shape[0] / 2)]), name
    (peak,) = peaks
    # Its half of the fp32 model, plus its rows of one parameter in flight (read in bf16, then cast), plus slack.
    assert peak <= total / 2 + largest + 4 * 2**20, (peak, total, largest)

    # The measure sees a whole model when one is loaded: what load-then-shard allocated on every rank.
    with PeakAllocated() as whole:
        load_model(moe_folder, dtype=torch.float32)
    assert whole.peak >= 0.9 * total > peak


def test_an_export_is_written_as_it_streams_one_shard_at_a_time(tmp_path, moe_folder):
    """save_state_dict takes (name, tensor) pairs as a sharded learner gathers them, writing each safetensors shard
    as soon as it is full: what it holds at once is one shard, not the model."""
    from rlpipe.models import load_state_dict, read_hf_config, save_state_dict

    def gathered(count: int = 24, rows: int = 512):
        for index in range(count):  # 1 MiB of fp32 each, made as it is asked for, like a gathered parameter
            yield f"model.layers.{index}.mlp.up_proj.weight", torch.full((rows, 512), float(index))

    with PeakAllocated() as measure:
        save_state_dict(gathered(), read_hf_config(moe_folder), tmp_path / "out", max_shard_bytes=3 * 2**20)
    assert measure.peak <= 6 * 2**20, measure.peak  # a shard (3 MiB) and the tensor on its way, not 24 MiB
    index = (tmp_path / "out" / "model.safetensors.index.json").read_text()
    assert "model-00008-of-00008.safetensors" in index
    state = load_state_dict(tmp_path / "out")
    assert len(state) == 24 and all(float(state[f"model.layers.{i}.mlp.up_proj.weight"][0, 0]) == i for i in range(24))
