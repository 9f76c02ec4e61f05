"""The rollout engine adapter: one vLLM engine that samples groups with logprobs and takes weight updates.

No Ray here, so it runs (and is tested) in one process; actors/rollout.py wraps it as an actor. What one generate
call samples, single completions or multi-turn episodes with tools, is the episode runner's, chosen when the engine
starts (rlpipe/tools/runner.py); the engine starts vLLM and runs the requests the runner makes. The engine's end
of the weight sync is a `WeightReceiver` (rlpipe/weightsync/receiver.py) given this engine's write, probe and
pause; the write itself runs in vLLM's workers (rlpipe/rollout/vllm_worker.py). How a version is written is the writer of
the run's weight form (rlpipe/weightsync/form.py), chosen once when the engine starts (`engine_writer`): whole weights
(`WeightsWriter`, full or merged), or adapters alone (`AdapterWriter`): the engine loads the base once, the first
version is loaded through vLLM's LoRA support (an adapter folder), later ones are written into the LoRA buffers vLLM
set up for it, and every generation applies it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

from rlpipe.config import KernelsConfig, RolloutConfig, SyncConfig, first_line, torchtpu_refusal
from rlpipe.config.sync import vllm_lora_rank
from rlpipe.training.lora import AdapterFolders, adapter_root
from rlpipe.models.hf import load_model_weights, read_hf_config
from rlpipe.tools.runner import episode_runner
from rlpipe.types import Completion, Prompt
from rlpipe.rollout.vllm_worker import encode_weights, vllm_platform
from rlpipe.weightsync.form import FULL, Kind, WeightForm
from rlpipe.weightsync import (
    DECODE_TOKENS,
    DecodedProbe,
    EngineLayout,
    SyncError,
    WeightReceiver,
    make_transport,
)
from rlpipe.weightsync.hostcopy import HostCopy


def workers_in_process(cfg: RolloutConfig) -> bool:
    """Whether the engine's one worker runs in this process (rollout.in_process, one chip); tensor-parallel workers
    are processes of their own either way."""
    return cfg.in_process and cfg.tensor_parallel == 1


def engine_variables(kv_cache_gib: int, in_process: bool) -> None:
    """vLLM's settings of an engine in this process's environment, before anything of vLLM reads them: its KV cache
    on CPU, and whether its engine core runs in this process."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    # vLLM reserves one core for itself by default, a large share of generation's speed on a host of few cores
    # (docs/benchmarks.md).
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


# vLLM on CPU caches prefixes in blocks of 128 tokens by default, so prompts shorter than 129 tokens are never
# shared: each of a group's samples ran its prompt again (on the e2e workload, 64 prompts of ~50 tokens a step,
# over 40 % of the tokens the engine computed). 32 is the smallest block its attention takes.
CPU_KV_BLOCK_SIZE = 32


def sampling_params(cfg: RolloutConfig, n: int, *, temperature: float | None = None, max_tokens: int | None = None):
    """vLLM's sampling parameters of rollouts (and, with temperature 0, of the greedy evaluation): the rollout
    section's sampling keys, `n` completions per prompt, and the sampled token's log-prob at each step."""
    from vllm import SamplingParams

    return SamplingParams(
        n=n,
        temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        repetition_penalty=cfg.repetition_penalty,
        # The learner trains on the token ids, which hold the stop string: the text a reward reads keeps it too.
        stop=list(cfg.stop) or None,
        include_stop_str_in_output=True,
        max_tokens=max_tokens or cfg.max_tokens,
        logprobs=0,
        **cfg.generation_kwargs,
    )


# The one adapter an engine serves: every version is loaded under this id, in place of the one before.
POLICY_ADAPTER = ("rlpipe-policy", 1)


def given_sequence_logprobs(llm, sequences: list[list[int]], lora_request=None) -> list[list[float] | None]:
    """vLLM's log-prob of each token of each sequence given the ones before it (position 0 gets 0.0), read from the
    sequence sent as a prompt (its prompt log-probs; one token generated, unused); None for a sequence the engine
    returns none for (vLLM on TorchTPU)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in sequences], params, use_tqdm=False,
                           lora_request=lora_request)
    return [
        None if output.prompt_logprobs is None
        else [0.0] + [float(step[token].logprob) for step, token in zip(output.prompt_logprobs[1:], ids[1:])]
        for output, ids in zip(outputs, sequences)
    ]


def decoding_params():
    """vLLM's sampling parameters of a decoded probe: greedy, DECODE_TOKENS tokens whatever they are."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True, logprobs=0)


class WriteTimedOut(BaseException):
    """vLLM gave up waiting for a worker's write. Its executor matches replies to calls by order, so nothing more may
    go through it (a rollback's write would take the late reply as its own): like a write that broke off, it leaves
    the engine unusable, and the engine is replaced."""


def _start_vllm(model_path: str, tokenizer_path: str | None, cfg: RolloutConfig, seed: int, *, platform: str,
                kernels: KernelsConfig | None, progress_bars: bool, extra: dict):
    """vLLM's engine for `rollout` (its environment variables set already, `engine_variables`), with rlpipe's weight writer
    in its workers; `extra`: more of LLM's arguments."""
    from vllm import LLM
    from vllm.platforms import current_platform

    extra = dict(extra)
    if cfg.model_impl == "rlpipe":
        from rlpipe.rollout.vllm_model import engine_overrides, register

        register()  # in this process; vLLM's worker processes register it through the plugin entry point
        # vLLM on TorchTPU compiles the model for TorchTPU.
        kernels = (kernels or KernelsConfig()).decided(compiled_for_tpu=platform == "torchtpu")
        extra["hf_overrides"] = engine_overrides(kernels.rmsnorm, kernels.experts)
    block_size = cfg.kv_block_size or (CPU_KV_BLOCK_SIZE if current_platform.is_cpu() else None)
    if block_size:
        extra["block_size"] = block_size
    return LLM(
        model=model_path,
        tokenizer=tokenizer_path or model_path,
        dtype=cfg.dtype,
        seed=seed,  # per-request seeds crash vllm-cpu 0.32, so the engine carries the seed
        max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tensor_parallel,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enforce_eager=current_platform.is_cpu() if cfg.enforce_eager is None else cfg.enforce_eager,
        # One worker runs in this process; several are vLLM's worker processes whichever way the engine runs.
        distributed_executor_backend="uni" if workers_in_process(cfg) else None,
        worker_extension_cls="rlpipe.rollout.vllm_worker.WeightWriter",
        # The log-probs of the distribution the learner computes (RolloutConfig.logprobs_mode, docs/algorithms.md).
        logprobs_mode=cfg.logprobs_mode(),
        use_tqdm_on_load=progress_bars,
        **extra,
    )


class RolloutEngine:
    """One vLLM engine. Generation and weight sync may be called from two threads (the rollout actor runs them in
    separate concurrency groups): a sync receives its buckets while generation goes on, and pauses generation
    only to write the weights, per `sync.on_generation`."""

    def __init__(
        self,
        model_path: str,
        cfg: RolloutConfig,
        seed: int,
        tokenizer_path: str | None = None,
        sync: SyncConfig | None = None,
        *,
        kernels: KernelsConfig | None = None,
        progress_bars: bool = True,
        form: WeightForm = FULL,
    ):
        """`kernels`: `model.kernels`, which rlpipe's model runs in the engine (`rollout.model_impl: rlpipe`);
        `progress_bars`: vLLM's progress bar while it loads the weights; `form`: the run's weight form, whose writer
        (`engine_writer`) writes each version."""
        engine_variables(cfg.kv_cache_gib, cfg.in_process)  # before anything of vLLM reads its settings
        platform = vllm_platform()
        if platform == "tpu-inference":
            raise RuntimeError(
                "rollout: vLLM's JAX TPU platform (tpu-inference) is not supported; rlpipe's TPU engines run vLLM on "
                "TorchTPU (vllm-torchtpu, the `tpu` extra)"
            )
        sync = sync or SyncConfig()
        if platform == "torchtpu" and (refused := torchtpu_refusal(cfg, sync)):
            raise RuntimeError(refused)

        self.cfg = cfg
        self.sync_cfg = sync
        # vLLM on TorchTPU returns no prompt log-probs, so there the probe is decoded (rlpipe/weightsync/probe.py).
        self.probe_by_decoding = sync.probe == "decode" or (sync.probe == "auto" and platform == "torchtpu")
        self.model_path = model_path
        self.writer = engine_writer(form, self, platform)
        self.llm = _start_vllm(model_path, tokenizer_path, cfg, seed, platform=platform, kernels=kernels,
                               progress_bars=progress_bars, extra=self.writer.vllm_options())
        self.llm.collective_rpc("rlpipe_count_ranks_eagerly")
        # Generation and weight writes exclude each other; a waiting sync blocks new generation.
        self._state = threading.Condition()
        self._generating = False
        self._sync_waiting = False
        self._abort_generation = False
        transport = make_transport(sync.transport)
        # The version the workers read: staging's own segment where they share this host's memory (see
        # _staging_memory); else one copy of this engine's, for the length of the write.
        self.host_copy = HostCopy(chunk_bytes=int(sync.bucket_mb * 2**20))
        self._shared_with_workers: bool | None = None
        # Single- or multi-turn, decided here: a multi-turn runner loads the recipe's tools in this process.
        self.episode_runner = episode_runner(cfg)
        if not workers_in_process(cfg):  # asked now, while the engine is idle: staging asks at every sync
            self._workers_share_memory()
        self.sync = WeightReceiver(
            transport,
            write=self.writer.write,
            probe=self._probe,
            initial_weights=self.writer.initial_weights,
            paused=self._generation_paused,
            tolerance=sync.probe_tolerance_for(cfg.dtype),
            # float32 engines reproduce the learner token for token; bf16 kernels differ a little on every token.
            exact=cfg.dtype == "float32",
            keep_previous=sync.keep_previous,
            host_memory=self.writer.staging_memory,
        )

    def close(self) -> None:
        """Stop the engine and free the transport's buffers (an in-process engine otherwise shuts down at
        interpreter exit, after other code may have torn down the process groups it expects)."""
        self.sync.close()
        self.host_copy.close()
        self.llm.llm_engine.engine_core.shutdown()
        self.writer.close()

    # ------------------------------------------------------------------ generation

    def generate(
        self, prompts: list[Prompt], n: int, *, temperature: float | None = None, max_tokens: int | None = None
    ) -> list[list[Completion]]:
        """`n` completions (or episodes, rlpipe/tools/runner.py) per prompt, each with its sampled tokens' logprobs.
        A prompt whose requests a weight sync aborted (`sync.on_generation: abort`) comes back with no completions;
        callers resubmit it."""
        params = sampling_params(self.cfg, n, temperature=temperature, max_tokens=max_tokens)
        with self._state:
            self._state.wait_for(lambda: not self._sync_waiting)
            if self.sync.unusable:
                raise SyncError(self.sync.unusable)
            self._generating, version = True, self.sync.policy_version
        try:  # a whole episode runs under one policy version: a sync waits for it, or aborts it
            return self.episode_runner.run(prompts, n, params, version, sample=self._run,
                                           tokenizer=self.llm.get_tokenizer())
        finally:
            with self._state:
                self._generating = self._abort_generation = False
                self._state.notify_all()

    def _run(self, prompts: list, params) -> list:
        """vLLM's offline loop, written out so that a sync can abort it between engine steps."""
        engine = self.llm.llm_engine
        # enqueue() returns engine-internal ids ("<id>-<suffix>"); outputs and abort_request use the part before.
        enqueued = self.llm.enqueue(prompts, params, use_tqdm=False, lora_request=self.writer.lora_request)
        request_ids = [internal.rsplit("-", 1)[0] for internal in enqueued]
        finished = {}
        while engine.has_unfinished_requests():
            if self._abort_generation:
                engine.abort_request([rid for rid in request_ids if rid not in finished])
                break
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished.get(rid) for rid in request_ids]

    def seed(self, seed: int) -> None:
        """Re-seed sampling, so that a step's completions depend on the step, not on what came before (exact
        resume: a resumed run samples step k as the uninterrupted run did)."""
        self.llm.collective_rpc("rlpipe_seed", args=(seed,))

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """The engine's logprob of each token given the ones before it (position 0 gets 0.0)."""
        (logprobs,) = given_sequence_logprobs(self.llm, [token_ids], lora_request=self.writer.lora_request)
        if logprobs is None:
            raise SyncError("this engine returns no log-probs of a given sequence (vLLM on TorchTPU); decode instead")
        return logprobs

    def decoded_probe(self, token_ids: list[int]) -> DecodedProbe:
        """DECODE_TOKENS tokens decoded greedily after `token_ids`, with their log-probs (the probe of an engine
        that cannot replay a sequence)."""
        from vllm.inputs import TokensPrompt

        (output,) = self.llm.generate([TokensPrompt(prompt_token_ids=token_ids)], decoding_params(), use_tqdm=False,
                                      lora_request=self.writer.lora_request)
        sample = output.outputs[0]
        tokens = list(sample.token_ids)
        return DecodedProbe(tokens, [step[token].logprob for step, token in zip(sample.logprobs, tokens)])

    # ------------------------------------------------------------------ weight sync

    def layout(self) -> tuple[EngineLayout, list[str]]:
        """This engine's layout for the sync plan, and its parameter names (what a plan of whole weights is checked
        against)."""
        (fused, params), *_ = self.llm.collective_rpc("rlpipe_layout")
        tp = self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
        layout = EngineLayout.from_hf_config(read_hf_config(self.model_path), tp, self.cfg.dtype, fused, params)
        return layout, params

    @property
    def policy_version(self) -> int:
        """The version of the weights this engine serves (0: those it loaded)."""
        return self.sync.policy_version

    def _probe(self, token_ids: list[int]) -> list[float] | DecodedProbe:
        return self.decoded_probe(token_ids) if self.probe_by_decoding else self.sequence_logprobs(token_ids)

    @contextlib.contextmanager
    def _generation_paused(self) -> Iterator[None]:
        """No generation runs inside: in-flight requests finish first, or are aborted (`sync.on_generation`), and
        new ones wait until the context ends."""
        with self._state:
            self._sync_waiting = True
            self._abort_generation = self.sync_cfg.on_generation == "abort"
            self._state.wait_for(lambda: not self._generating)
        try:
            yield
        finally:
            with self._state:
                self._sync_waiting = False
                self._state.notify_all()

    def _workers_share_memory(self) -> bool:
        """Whether every worker finds this process's files in /dev/shm (asked once): vLLM's multiprocessing
        executor runs them on this host, its Ray executor wherever Ray places them."""
        if self._shared_with_workers is None:
            with self.host_copy.marker() as marker:
                self._shared_with_workers = all(self.llm.collective_rpc("rlpipe_sees_file", args=marker))
        return self._shared_with_workers

    def _load_weights(self, message, in_place: bool) -> None:
        """Every worker writes `message`'s tensors (`_call_workers`)."""
        self._call_workers("rlpipe_load_weights", (message, in_place))

    def _call_workers(self, method: str, args: tuple) -> list:
        """Every worker's answer to a write, within sync.timeout_s: vLLM's executors otherwise wait forever on a
        worker that died mid-write."""
        try:
            return self.llm.collective_rpc(method, timeout=self.sync_cfg.timeout_s, args=args)
        except Exception as err:
            # vLLM's own timeout (a TimeoutError here, or its engine process's message): the executor matches replies
            # to calls by order, so a late reply would answer the next call, a rollback's write included.
            if isinstance(err, TimeoutError) or "timed out" in str(err):
                raise WriteTimedOut(f"a worker did not finish writing within sync.timeout_s "
                                    f"{self.sync_cfg.timeout_s:g} s ({first_line(err)})") from err
            raise



class WeightsWriter:
    """How an engine takes whole weights (the `full` and `merged` forms): every worker's vLLM loaders copy their part
    of each tensor. Version 0 is the model folder's weights, under the learner's names (which both vLLM's loaders
    and rlpipe's model in vLLM take)."""

    lora_request = None  # generation applies no adapter

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    def vllm_options(self) -> dict:
        return {}

    def initial_weights(self) -> dict[str, torch.Tensor]:
        engine = self.engine
        return load_model_weights(engine.model_path, getattr(torch, engine.cfg.dtype))

    def staging_memory(self) -> HostCopy | None:
        """Where staging assembles a version: in the host copy's shared memory when the workers read it (then the
        write copies nothing), else (an in-process engine, workers elsewhere) in plain memory of the engine's."""
        engine = self.engine
        return engine.host_copy if not workers_in_process(engine.cfg) and engine._workers_share_memory() else None

    def write(self, weights: dict[str, torch.Tensor]) -> None:
        """Every worker writes its part of `weights`. Workers in child processes on this host read one shared host
        copy (rlpipe/weightsync/hostcopy.py): the RPC carries where each tensor lies, never its bytes."""
        engine = self.engine
        in_place = engine.sync_cfg.engine_write == "in_place"
        if workers_in_process(engine.cfg):  # the worker is this process: the tensors themselves
            engine._load_weights(list(weights.items()), in_place)
        elif engine._workers_share_memory():
            with engine.host_copy.publish(weights) as shared:
                engine._load_weights(shared.message(), in_place)
        else:  # some worker does not see this host's /dev/shm (vLLM's Ray executor may place them elsewhere)
            engine._load_weights(encode_weights(weights), in_place)
        # Cached prefixes hold keys/values computed by the old weights.
        engine.llm.reset_prefix_cache()

    def close(self) -> None:
        pass


class AdapterWriter:
    """How an engine takes the adapters alone (the `adapters` form): vLLM holds one adapter slot (enable_lora), the
    base weights stay as loaded, and every generation applies the adapter (`lora_request`). Version 0 is the base
    alone, as the learner's fresh adapters (B = 0) leave it. The adapters' settings are the form's."""

    def __init__(self, engine: RolloutEngine, form: WeightForm, platform: str):
        if platform == "torchtpu":  # the run was decided for another platform's engines
            raise RuntimeError(
                "learner.lora: this engine runs vLLM on TorchTPU, whose LoRA path is not verified; set sync.lora=merged"
            )
        if engine.cfg.model_impl == "rlpipe":
            raise RuntimeError("rollout: rlpipe's model in vLLM takes no LoRA adapters; sync.lora must be merged")
        self.engine, self.form = engine, form
        self.lora_request = None  # the adapter every generation applies; None: the base alone (version 0)
        self.folders = AdapterFolders(adapter_root(), form.lora, engine.model_path)
        self._loaded_path: str | None = None  # the folder vLLM last loaded the adapter from (None: none yet)

    def vllm_options(self) -> dict:
        # One adapter, replaced in place at every sync; on CPU vLLM then runs the model uncompiled.
        return dict(enable_lora=True, max_lora_rank=vllm_lora_rank(self.form.lora.rank), max_loras=1)

    def initial_weights(self) -> dict[str, torch.Tensor]:
        return {}

    def staging_memory(self) -> HostCopy | None:
        return None  # this process writes the adapters (to a folder, or to the workers as bytes)

    def write(self, adapters: dict[str, torch.Tensor]) -> None:
        """Serve `adapters` (the received, checked version; empty: the base alone, version 0). Once vLLM has loaded
        an adapter into its slot, each later version is written straight into that slot's LoRA buffers by the
        workers and read back there (`WeightWriter.rlpipe_write_adapters`). The first version, and any the slot
        cannot take as it is, go as a PEFT folder that vLLM loads in place of the adapter it served; the folder is
        removed after a direct write, so that vLLM cannot load an older version from it again."""
        from vllm.lora.request import LoRARequest

        llm = self.engine.llm
        name, lora_id = POLICY_ADAPTER
        if not adapters:
            self.lora_request = None
        elif self._loaded_path is not None and self._write_directly(adapters, lora_id):
            self.folders.clear()
            self.lora_request = LoRARequest(name, lora_id, self._loaded_path)
        else:
            folder = str(self.folders.write(adapters))
            # load_inplace replaces the adapter held under this id; generation's requests leave it off, or every
            # engine step would load the folder again (vllm/lora/worker_manager.py add_adapter).
            if not llm.llm_engine.add_lora(LoRARequest(name, lora_id, folder, load_inplace=True)):
                raise SyncError(f"vLLM did not load the adapter folder {folder}")
            self._loaded_path = folder
            self.lora_request = LoRARequest(name, lora_id, folder)
        # Cached prefixes hold keys/values computed with the previous adapter (same id).
        llm.reset_prefix_cache()

    def _write_directly(self, adapters: dict[str, torch.Tensor], lora_id: int) -> bool:
        """Every worker writes `adapters` into the slot of adapter `lora_id`; False where a worker's slot cannot take
        them (each checks before it writes; the folder that is loaded then replaces whatever another wrote)."""
        engine = self.engine
        tensors = list(adapters.items()) if workers_in_process(engine.cfg) else encode_weights(adapters)
        return all(engine._call_workers("rlpipe_write_adapters", (tensors, lora_id, self.form.scaling)))

    def close(self) -> None:
        self.folders.remove()


def engine_writer(form: WeightForm, engine: RolloutEngine, platform: str) -> WeightsWriter | AdapterWriter:
    """The writer of `form`'s versions for `engine` on vLLM's `platform`: whole weights (full or merged) or the
    adapters alone."""
    if form.kind is Kind.ADAPTERS:
        return AdapterWriter(engine, form, platform)
    return WeightsWriter(engine)
