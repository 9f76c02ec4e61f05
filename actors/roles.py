"""A run's roles as Ray actors, started together and torn down together.

Generation goes to the engine pool (actors/engine_pool.py), scoring to the reward pool (actors/reward_pool.py),
training, checkpoints and export to the learner ranks; the weight sync (actors/sync_channel.py) owns everything
between the learner and the engines and admits any engine the pool starts again. Every call to an actor has a
deadline (`ray.start_timeout_s` for the start-up, `learner.call_timeout_s` for the learner's work, the engine pool's
and the sync's own); one passed stops the run as a lost worker (CallTimeout), which `--auto-resume` restarts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace

import ray

from rlpipe.actors.calls import WorkerLost, get_all, settle
from rlpipe.actors.cluster import compute_env
from rlpipe.actors.engine_pool import EnginePool, Generation
from rlpipe.actors.learner import LearnerActor
from rlpipe.actors.placement import PlacedRole, place_role
from rlpipe.actors.reward import RewardActor
from rlpipe.actors.reward_pool import RewardPool
from rlpipe.actors.scorer import ScorerActor, teacher_call
from rlpipe.actors.sync_channel import SyncChannel
from rlpipe.config import Config, first_line
from rlpipe.hardware.device import learner_variables, learner_processes
from rlpipe.hardware.gpu_layout import gpu_layout
from rlpipe.startup.preflight import check_cluster_resources
from rlpipe.scoring.served import ServedModel, served_models, served_teacher
from rlpipe.scoring.teacher import TEACHER
from rlpipe.rewards.child import CallFailed
from rlpipe.rewards.specs import reward_names
from rlpipe.training.learner import combine_rank_metrics
from rlpipe.reporting.logs import LogSetup
from rlpipe.hardware.tpu_layout import SliceShare, slice_shares
from rlpipe.types import Group, Prompt, StepScores, TrainBatch
from rlpipe.weightsync.form import FULL, WeightForm


class EngineRoles:
    """The engine pool and the reward pool of a run, placed as the config says; what a loop drives
    (`rlpipe.types.LoopRoles`): generation (an engine that dies is replaced, see `_admit`), seeding and scoring.
    `Roles` adds the learner ranks and the weight sync; `EvalRoles` (actors/eval_roles.py) is these alone."""

    def __init__(self, cfg: Config, note: Callable[[str], None] = print, log: LogSetup | None = None):
        self.cfg, self.note, self.log = cfg, note, log
        self.placements: list[PlacedRole] = []
        self.rewarders: list = []
        self.scorers: list = []
        self.pool: EnginePool | None = None
        self.rewards: RewardPool | None = None
        self.regenerated = 0  # prompts generated again so far (an engine's death lost them, a sync aborted them)

    def _place(
        self, role: str, actors: int, chips_per_actor: int = 1, gpus_per_actor: float = 0,
        learner_device: str | None = None, share: SliceShare | None = None, sharing: PlacedRole | None = None,
        paired: int = 0,
    ) -> PlacedRole:
        placed = place_role(
            role, getattr(self.cfg.placement, role), actors, self.cfg.ray.placement_timeout_s, chips_per_actor,
            gpus_per_actor, learner_device, share, sharing, paired,
        )
        self.placements.append(placed)
        return placed

    def place_learner_and_engines(self) -> tuple[PlacedRole, PlacedRole]:
        """The learner ranks' placement and the engines': TPU chips, GPUs (an engine sharing a rank's GPU goes in
        that rank's bundle, rlpipe/hardware/gpu_layout.py) or CPUs."""
        cfg = self.cfg
        shares, gpus = slice_shares(cfg.placement), gpu_layout(cfg)
        ranks = learner_processes(cfg.learner.device, cfg.learner.ranks)
        learners = self._place("learner", ranks, chips_per_actor=cfg.learner.ranks // ranks,
                               gpus_per_actor=gpus.learner, learner_device=cfg.learner.device,
                               share=shares.get("learner"), paired=gpus.engines if gpus.colocated else 0)
        one_host = learners.share is not None and learners.share.shared  # both roles on one TPU VM's chips
        engines = self._place("rollout", cfg.rollout.num_engines, chips_per_actor=cfg.rollout.tensor_parallel,
                              gpus_per_actor=gpus.rollout, share=shares.get("rollout"),
                              sharing=learners if one_host or gpus.colocated else None)
        return learners, engines

    def _start_rewards(self, placed: PlacedRole, columns: list[str] | None) -> None:
        """The reward workers on `placed`, the scorer role where a model scores entries of reward.functions, and the
        pool that shares samples out to the workers."""
        cfg = self.cfg
        specs = [asdict(spec) for spec in cfg.reward.functions]
        self._start_scorers(self._served(specs))
        # Reward actors hold no state a step needs, so Ray restarts a dead one and re-runs its call there: the share
        # it was scoring is scored once, by the new process (tests/integration/test_grpo_e2e.py kills one).
        restarts = cfg.reward.max_restarts
        self.rewarders = [
            RewardActor.options(**placed.options(index), max_restarts=restarts, max_task_retries=restarts).remote(
                specs, cfg.reward, columns, self._log_setup("reward", index),
                self.scorers[index % len(self.scorers)] if self.scorers else None,
            )
            for index in range(cfg.reward.num_workers)
        ]
        self.rewards = RewardPool(
            self.rewarders, cfg.rollout.max_tokens, restarts, cfg.reward.deadline_s, reward_names(specs)
        )

    def _served(self, specs: list[dict]) -> dict[str, ServedModel]:
        """What the scorer role serves: the models that score entries of reward.functions (`specs`)."""
        return served_models(specs)

    def _start_scorers(self, served: dict[str, ServedModel]) -> None:
        """`scorer.num_workers` scorer actors, each loading the models of `served`; none without them. A dead one is
        started again, and the call it was answering is sent again (actors/scorer.py's `scorer_call`)."""
        if not served:
            return
        scorer = self.cfg.scorer
        placed = self._place("scorer", scorer.num_workers)
        options = {"max_restarts": scorer.max_restarts}
        self.scorers = [
            ScorerActor.options(**placed.options(index, compute_env(self.cfg)), **options).remote(
                served, scorer, self._log_setup("scorer", index)
            )
            for index in range(scorer.num_workers)
        ]

    def ready_calls(self) -> dict[str, list]:
        """A call per engine, reward worker and scorer that answers once the actor has started and loaded."""
        calls = {"rollout": [engine.policy_version.remote() for engine in self.pool.engines],
                 "reward": [rewarder.names.remote() for rewarder in self.rewarders]}
        if self.scorers:
            calls["scorer"] = [scorer.names.remote() for scorer in self.scorers]
        return calls

    def _log_setup(self, role: str, index: int) -> LogSetup | None:
        return None if self.log is None else replace(self.log, who=f"{role}-{index}")

    def _admit(self, index: int) -> None:
        """Bring engine `index`, just started again by the pool, to the weights the others serve: here the model
        folder's, which it loaded."""

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[Prompt], n: int, **sampling) -> list[Group]:
        return self.finish_generation(self.start_generation(prompts, n, **sampling))

    def start_generation(self, prompts: list[Prompt], n: int, **sampling) -> Generation:
        """Send the prompts to the engines and return at once (asynchronous mode keeps the engines generating the
        next step while the learner trains)."""
        return self.pool.start_generation(prompts, n, **sampling)

    def finish_generation(self, generation: Generation) -> list[Group]:
        """Collect the completions. An engine that died (killed, out of memory) is replaced and given the current
        weights, and only the prompts it held are generated again, so every prompt comes back exactly once. A prompt
        whose requests a weight sync aborted comes back empty; it is sampled again too, by the new policy."""
        completions, replaced = self.pool.collect(generation)
        for index in replaced:
            self._admit(index)
        retry = [index for index, group in enumerate(completions) if not group]
        if retry:
            self.regenerated += len(retry)
            again = self.generate([generation.prompts[i] for i in retry], generation.n, **generation.sampling)
            for index, group in zip(retry, again):
                completions[index] = group.completions
        return [Group(prompt, group) for prompt, group in zip(generation.prompts, completions)]

    def seed(self, step: int) -> None:
        """Seed every engine's sampling for this step (see RolloutEngine.seed); an engine that died since the last
        step is replaced, brought to the current weights, then seeded."""
        for index in self.pool.seed(step):
            self._admit(index)
            self.pool.seed_engine(index, step)

    def score(self, groups: list[Group], trainer_state: dict | None = None) -> StepScores:
        return self.rewards.score(groups, trainer_state)

    def _actors(self) -> list:
        return [*(self.pool.engines if self.pool is not None else []), *self.rewarders, *self.scorers]

    def shutdown(self) -> None:
        """End every actor. Engines are closed first, within rollout.close_timeout_s (vLLM's processes stop and their
        shared memory goes; an engine killed without it leaves that to the next engine on its host to sweep)."""
        if self.pool is not None and self.pool.engines:
            settle([engine.close.remote() for engine in self.pool.engines], self.cfg.rollout.close_timeout_s)
        for handle in self._actors():
            ray.kill(handle)
        for placed in self.placements:
            placed.remove()


class Roles(EngineRoles):
    """The learner ranks, the engine pool, the reward pool and the weight sync between learner and engines."""

    def __init__(
        self,
        cfg: Config,
        model_path: str,
        tokenizer_path: str | None = None,
        resume: dict | None = None,
        note: Callable[[str], None] = print,
        reward_columns: list[str] | None = None,
        log: LogSetup | None = None,
        form: WeightForm = FULL,
    ):
        """`resume`: {"learner": directory of a checkpoint's learner state, "rng": each rank's RNG state or None}.
        `note`: where to report events worth a line in the run's log (an engine restarted).
        `reward_columns`: the dataset's columns every scored batch carries, checked against the reward functions'
        signatures when the reward workers start (None: not known here, see RewardRunner).
        `log`: how the actors log (rlpipe/reporting/logs.py), each tagged with its role and index; None leaves their logging
        as the libraries set it.
        `form`: the run's weight form (`rlpipe.weightsync.form.weight_form`), handed to the learner ranks and the engines."""
        super().__init__(cfg, note, log)
        self.form = form
        # An actor that cannot be placed waits forever; say so instead of hanging.
        check_cluster_resources(cfg, ray.cluster_resources())
        self.learners: list = []
        self.sync: SyncChannel | None = None
        self.startup: dict[str, float] = {}  # seconds of the start-up's parts (`_start`)
        try:
            self._start(model_path, tokenizer_path, resume, reward_columns)
        except BaseException:  # release what did start: placement groups would otherwise hold the cluster
            self.shutdown()
            raise

    def _start(self, model_path: str, tokenizer_path: str | None, resume: dict | None, columns: list[str] | None):
        cfg = self.cfg
        ranks = learner_processes(cfg.learner.device, cfg.learner.ranks)
        learners, engines = self.place_learner_and_engines()
        rewarders = self._place("reward", cfg.reward.num_workers)
        self.pool = EnginePool(cfg, engines, model_path, tokenizer_path, self.note, self.log, self.form)
        # Before any actor starts: a route the cluster cannot take fails here.
        # In asynchronous mode an engine's commit may first let the generation in flight finish.
        finish_first = cfg.train.max_staleness > 0 and cfg.sync.on_generation == "finish"
        generation_wait_s = cfg.rollout.generate_timeout_s if finish_first else 0.0
        self.sync = SyncChannel(cfg.sync, cfg.rollout.max_model_len, learners.hosts(), self.pool, self.note,
                                generation_wait_s)
        env = compute_env(cfg) | learner_variables(cfg.learner.device, cfg.learner.ranks)
        self.learners = [
            LearnerActor.options(**learners.options(rank, env)).remote(
                model_path, cfg, rank, ranks, self._log_setup("learner", rank), self.form
            )
            for rank in range(ranks)
        ]
        self.pool.start()
        self._start_rewards(rewarders, columns)
        # Surface a bad model folder or reward path now rather than at the first step; note when each role was
        # ready (its processes started, imported and loaded), counted from here.
        began, arrivals = time.monotonic(), {}
        ready = {"learner": [learner.policy_version.remote() for learner in self.learners], **self.ready_calls()}
        get_all(sum(ready.values(), []), self.cfg.ray.start_timeout_s, "the roles", "their start (model load)",
                "ray.start_timeout_s", arrivals)
        self.startup = {f"startup/{role}_ready_s": max(arrivals[ref] for ref in refs) - began
                        for role, refs in ready.items() if refs}
        began = time.monotonic()
        address, port = self._starting([self.learners[0].rendezvous_address.remote()], "learner rank 0",
                                       "rendezvous_address")[0]
        self._starting([learner.join_process_group.remote(address, port) for learner in self.learners],
                       "a learner rank", "join_process_group")
        self.startup["startup/process_group_s"] = time.monotonic() - began
        version = 0
        if resume is not None:
            rngs = resume["rng"] if len(resume["rng"] or []) == ranks else [None] * ranks  # other M: fresh RNG
            version = self._starting(
                [learner.load_checkpoint.remote(resume["learner"], rng) for learner, rng in zip(self.learners, rngs)],
                "a learner rank", "load_checkpoint",
            )[0]
        began = time.monotonic()
        self.sync.open(self.learners, version)
        self.startup["startup/sync_check_s"] = time.monotonic() - began

    def _starting(self, refs: list, role: str, call: str) -> list:
        return get_all(refs, self.cfg.ray.start_timeout_s, role, call, "ray.start_timeout_s")

    def _learning(self, refs: list, call: str) -> list:
        return get_all(refs, self.cfg.learner.call_timeout_s, "a learner rank", call, "learner.call_timeout_s")

    def _served(self, specs: list[dict]) -> dict[str, ServedModel]:
        """The reward functions' models and the distillation teacher (algo.distill_teacher)."""
        return super()._served(specs) | served_teacher(self.cfg.algo.distill_teacher)

    def score(self, groups: list[Group], trainer_state: dict | None = None) -> StepScores:
        """The rewards, and with a teacher each sample's teacher log-probs (`_teach`)."""
        scores = super().score(groups, trainer_state)
        if self.cfg.algo.distill_teacher is not None:
            self._teach(groups)
        return scores

    def _teach(self, groups: list[Group]) -> None:
        """Fill in every completion's `teacher_logprobs`: the samples shared out evenly over the scorers, one call
        each within reward.timeout_s; a call that fails leaves its share without (no distillation signal) and says
        so in a line."""
        samples = [(group.prompt, completion) for group in groups for completion in group.completions]
        count = len(self.scorers)
        shares = [samples[index::count] for index in range(count)]

        def ask(index: int) -> None:
            sequences = [(completion.prompt_ids or prompt.token_ids, completion.token_ids)
                         for prompt, completion in shares[index]]
            try:
                found = teacher_call(self.scorers[index])(TEACHER, sequences, self.cfg.reward.timeout_s)
            except CallFailed as err:
                self.note(f"teacher: {err}; {len(sequences)} samples of this step have no distillation signal")
                found = [None] * len(sequences)
            for (_, completion), logprobs in zip(shares[index], found):
                completion.teacher_logprobs = logprobs

        with ThreadPoolExecutor(max_workers=count) as pool:
            list(pool.map(ask, range(count)))

    # ------------------------------------------------------------------ what the GRPO loop reads

    @property
    def engine_restarts(self) -> list[int]:
        return self.pool.restarts

    @property
    def retries(self) -> dict[str, float]:
        """Work done again so far, per kind: prompts generated again, weight-sync attempts repeated."""
        return {"retries/generate": float(self.regenerated), "retries/sync": float(self.sync.retries)}

    @property
    def policy_version(self) -> int:
        return self.sync.version

    @property
    def routes(self):
        return self.sync.routes

    @property
    def rehearsal(self) -> dict[str, float]:
        """The start-up rehearsal's metrics (SyncChannel._rehearse)."""
        return self.sync.rehearsal

    def where(self) -> dict[str, list[str]]:
        """The node id each actor runs on, as the actor itself reports it, per role in rank order."""
        def node_of(_actor) -> str:  # runs inside the actor
            return ray.get_runtime_context().get_node_id()

        return self._ask_every_actor(node_of)

    @staticmethod
    def hosts(placement: dict[str, list[str]]) -> dict[str, list[str]]:
        """The node addresses of `placement` (node ids per role, from `where`)."""
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        return {role: [addresses.get(node, node) for node in nodes] for role, nodes in placement.items()}

    def interpreters(self) -> dict[str, list[str]]:
        """The Python interpreter each actor runs under, as the actor itself reports it, per role in rank order."""
        def executable(_actor) -> str:  # runs inside the actor
            import sys

            return sys.executable

        return self._ask_every_actor(executable)

    def _ask_every_actor(self, question) -> dict[str, list]:
        roles = {"learner": self.learners, "rollout": self.pool.engines, "reward": self.rewarders,
                 **({"scorer": self.scorers} if self.scorers else {})}
        return {
            role: self._starting([h.__ray_call__.remote(question) for h in handles], f"the {role} role", "a question")
            for role, handles in roles.items()
        }

    # ------------------------------------------------------------------ training, the sync

    def _admit(self, index: int) -> None:
        self.sync.admit(index)

    def train(self, batch: TrainBatch) -> dict[str, float]:
        batch_ref = ray.put(batch)  # one copy in the object store, read by every rank
        try:
            sums = self._learning([learner.train_step.remote(batch_ref) for learner in self.learners], "train_step")
            return combine_rank_metrics(sums)
        except ray.exceptions.RayActorError as err:  # the other ranks cannot go on without it: the step stops
            raise WorkerLost(f"a learner rank died during a training step ({first_line(err)})") from err

    def sync_weights(self, probe: Group) -> dict[str, float]:
        """The learner's weights to every engine as the next policy version, verified (SyncChannel.push)."""
        return self.sync.push(probe)

    def export(self, out_dir: str) -> str:
        return self._learning([learner.export.remote(out_dir) for learner in self.learners], "export")[0]

    def save_checkpoint(self, directory: str) -> list[str]:
        """Every learner rank writes its part of the learner state (in parallel); returns their RNG states."""
        try:
            return self._learning([learner.save_checkpoint.remote(directory) for learner in self.learners],
                                  "save_checkpoint")
        except ray.exceptions.RayActorError as err:  # the save is abandoned; a restart from the last one may go on
            raise WorkerLost(f"a learner rank died while writing a checkpoint ({first_line(err)})") from err

    def _actors(self) -> list:
        return [*self.learners, *super()._actors()]

    def shutdown(self) -> None:
        if self.sync is not None:
            self.sync.close()
        super().shutdown()
