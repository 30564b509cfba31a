"""The Rollout role: n samples per prompt from the current policy, scored, written to the bus.

The same class runs in-process (colocate: the controller calls :meth:`produce` step by step) and as a
Ray actor (fully async: :meth:`run` loops, gated by the bus's staleness admission, while weights arrive
in the background over DCS). Every sample carries the policy version that generated it.

This class is the facade the controller and Ray call: it owns the engine (weights, device memory, DCS,
engine processes) and the loop, and hands the rest to rooms by concern: the prompts and the data position
(``prompts.py``), the generation of a batch (``generation.py``), the samples scored and put on the bus
(``samples.py``), the restart journal (``relax_core.resume.Journal``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, cast

from relax_bus import Bus
from relax_core.config import RelaxConfig
from relax_core.resume import Journal
from relax_core.role import Restart, RoleSpec, RolloutRecord
from relax_core.trace import Tracer
from relax_core.weight_audit import WeightAudit
from relax_core.weight_sync import WeightSubscriber
from relax_rollout.engine_factory import build_from_config, engine_kwargs
from relax_rollout.engine_service import EngineService, uses_pool
from relax_rollout.engines.base import RolloutEngine
from relax_rollout.engines.pauses import longest_pause
from relax_rollout.generation import Generation
from relax_rollout.prompts import Prompts
from relax_rollout.rewards import build_scorer
from relax_rollout.samples import SampleWriter
from relax_rollout.steps import RolloutSteps

if TYPE_CHECKING:
    from relax_rollout.agents import AgentHost, AgentServer
    from relax_rollout.streaming import GroupStream


def _reserve_engine_gpus(cfg: RelaxConfig, extra: dict[str, Any]) -> Any:
    """Fully async on a Ray cluster with GPUs: reserve the SGLang engines' GPUs through Ray (they are
    processes this role starts, outside Ray's accounting otherwise) and hand the engines those ids, so no
    other role is given them (:mod:`relax_core.placement`). Returns the placement group, or None where
    nothing is reserved: colocate mode (the roles time-share the GPUs), no Ray or no GPUs in it, ids set
    by hand (``gpu_ids``), or engines spread over nodes (``gpus_per_node``: those place themselves)."""
    if cfg.run.mode != "fully_async" or "gpu_ids" in extra or "gpus_per_node" in extra:
        return None
    import ray

    if not ray.is_initialized() or ray.cluster_resources().get("GPU", 0) <= 0:
        return None
    from relax_core.placement import reserve_gpus

    pg, extra["gpu_ids"] = reserve_gpus(cfg.rollout.rollout_num_gpus, "rollout")
    return pg


class RolloutWorker:
    role = "rollout"

    @classmethod
    def spec(cls, cfg: RelaxConfig, name: str) -> RoleSpec:
        """The producer (it writes the sample itself); a DCS receiver of every policy version; a restart
        goes on from its journal."""
        return RoleSpec(
            name,
            part="rollout",
            receives_weights=True,
            model="policy",
            restart=(Restart.JOURNAL, Restart.WEIGHTS),
        )

    def __init__(
        self, cfg: RelaxConfig, bus: Bus, model_path: str, prompt_path: str, torch_threads: int | None = None
    ):
        import torch
        from transformers import AutoTokenizer

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.cfg, self.bus = cfg, bus
        self.tracer = Tracer("rollout", cfg.run.trace)  # phases for trace.json
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        extra = engine_kwargs(cfg)  # the backend's arguments (relax_rollout.engine_factory)
        self._gpus = _reserve_engine_gpus(cfg, extra) if cfg.rollout.rollout_backend == "sglang" else None
        self.engine_service: EngineService | None = None
        engine: RolloutEngine
        if uses_pool(cfg):  # engines in their own processes, restarted when they crash, elastic
            self.engine_service = EngineService(cfg, model_path)  # (refuses --routing-replay)
            engine = self.engine_service.pool
        else:
            engine = build_from_config(cfg, model_path, self.tokenizer, extra)
            # (engine_kwargs allowed --routing-replay only for the torch and sglang engines: both record)
            if cfg.algo.routing_replay and getattr(engine, "routing", None) is None:
                raise ValueError(
                    f"--routing-replay needs an MoE model; {model_path} has no sparse MoE blocks"
                )
        self.stats = {"samples": 0, "generate_s": 0.0, "reward_s": 0.0, "wait_s": 0.0}
        _check_data(cfg, prompt_path)  # (a restarted rollout re-reads the file: the run's, or refused)
        self.prompts = Prompts(cfg, self.tokenizer, model_path, prompt_path, self.stats)
        self.scorer = build_scorer(cfg)
        self.weights = WeightSubscriber(
            cfg.run,
            lambda v, t: self.set_weights(t, v),
            lambda: self.generation.engine.weight_version,
            "rollout",
        )
        self.weight_log: dict[int, str] = {}
        self.audit = WeightAudit(cfg.run.output_dir, "rollout") if cfg.run.verify_weight_sync else None
        """--verify-weight-sync: each version's checksum as loaded, on disk (:mod:`relax_core.weight_audit`)."""
        # Every batch's start (prompt position) and landing on the bus are journaled: the trainer's
        # checkpoints read the data position there, and a rollout role restarted under the health manager
        # continues with exactly the prompts that were not put yet; there (fully async), samples get ids
        # fixed by their step, so a batch re-sent after a crash is refused (DuplicateIds).
        self.journal = Journal.for_run(cfg)
        """The restart journal (:class:`~relax_core.resume.Journal`; its ``path`` None: not journaled)."""
        restartable = cfg.run.mode == "fully_async" and cfg.run.health
        self.samples = SampleWriter(
            cfg,
            bus,
            self.tokenizer,
            self.scorer,
            self.tracer,
            restartable,
            pause=lambda: longest_pause(self.generation.engine),
        )
        self.agent_server, agents = _agents(cfg, engine, self.tokenizer, model_path, self.stats)
        """--agent-path: the engine served on 127.0.0.1 to the agents (:mod:`relax_rollout.agents`)."""
        self.generation = Generation(
            cfg, engine, self.tokenizer, self.prompts, self.tracer, self.stats, self.samples.score, agents
        )
        """Each batch's generation; its ``engine`` is the rollout engine."""
        self.steps = RolloutSteps(
            cfg,
            bus,
            self.journal,
            self.prompts,
            self.generation,
            self.samples,
            self.tracer,
            self.weights,
            self.stats,
        )
        """Each step's admission, generation and bus write, journaled (:mod:`.steps`)."""
        self.generation.alive = self.steps.alive

    # -- weights -------------------------------------------------------------------------------
    _stream: GroupStream | None = None  # the streaming loop (--streaming-rollout), while it runs

    def set_weights(self, tensors: dict[str, Any], version: int) -> None:
        engine = self.generation.engine
        if self._stream is not None:  # between decode steps (or once the responses in flight end)
            self._stream.update_weights(tensors, version)
        elif self.agent_server is not None:  # (the same, for the agents' calls)
            self.agent_server.update_weights(tensors, version)
        else:
            engine.update_weights(tensors, version)
        if self.audit is not None:  # (--verify-weight-sync)
            self.weight_log[version] = engine.weights_checksum()
            self.audit.log(version, self.weight_log[version])
        with self.steps.loaded:
            self.steps.loaded.notify_all()

    # -- device memory (colocate with offload) ----------------------------------------------------
    _released: frozenset[str] = frozenset()

    def release_memory(self) -> None:
        """Give the engine's device memory (weights, KV cache, graphs) back while the trainer runs."""
        from relax_rollout.engines.base import MEMORY_TAGS, ReleasesMemory

        engine = self.generation.engine
        if not isinstance(engine, ReleasesMemory):
            raise ValueError(
                f"--offload: the {self.cfg.rollout.rollout_backend} rollout engine cannot release its device "
                "memory; use --no-offload (or the torch / sglang engine)"
            )
        with self.tracer.span("release_memory"):
            engine.release_memory(None)
        self._released = frozenset(MEMORY_TAGS)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take back what :meth:`release_memory` gave (``tags``: part of it; default the rest)."""
        from relax_rollout.engines.base import ReleasesMemory, memory_tags

        todo = [t for t in memory_tags(tags) if t in self._released]
        if todo:
            with self.tracer.span("resume_memory", tags=",".join(todo)):
                # (released only by release_memory, which checked the engine can)
                cast(ReleasesMemory, self.generation.engine).resume_memory(todo)
            self._released = self._released - set(todo)

    def connect_dcs(self, init_method: str, world_size: int, rank: int) -> None:
        """Join the trainer's weight broadcast; called again when the health manager re-forms the group."""
        self.weights.connect_dcs(init_method, world_size, rank)

    def wait_weights(self, version: int, timeout_s: float = 300.0) -> int:
        """Block until the engine holds weights of ``version`` or newer (a restarted role)."""
        return self.weights.wait(version, timeout_s)

    def heartbeat(self) -> dict[str, Any]:
        """For the health manager: seconds since the loop last made progress (or polled idle)."""
        age = time.monotonic() - self.steps.beat if self.steps.beat else 0.0
        failed = self.engine_service.failed() if self.engine_service is not None else []
        return {"pid": os.getpid(), "age_s": age, "failed_engines": failed, "error": self.weights.load_error}

    def restart_engine(self, member_id: str) -> dict[str, Any]:
        """Health manager: replace a failed engine process (it gets the current weights first)."""
        assert self.engine_service is not None, "only engines of a pool fail and are restarted"
        return self.engine_service.restart(member_id)

    def weight_version(self) -> int:
        return self.generation.engine.weight_version

    # -- producing -----------------------------------------------------------------------------
    def produce(self, step: int) -> dict[str, float]:
        """Generate, score and put one rollout batch (step ``step``); returns timing stats."""
        return self.steps.finish(self.steps.collect(step))

    def load_data_state(self, state: dict[str, int] | None) -> None:
        """Continue from data position ``state`` (None: the data's start)."""
        if state is not None:
            self.prompts.iterator.load_state_dict(state)

    def run(self, start_step: int = 0) -> dict[str, float]:
        """Fully-async loop until the bus closes: admission by staleness, wait for fresh-enough
        weights, generate; scoring and the bus write of batch k run in a background thread while batch
        k+1 generates, so a slow (remote) reward overlaps generation instead of idling the engine. The
        staleness bound is unaffected: each batch is admitted, and tagged with its version, before it
        is generated."""
        import queue

        from relax_bus import BusClosed

        if self.cfg.rollout.streaming_rollout:  # prompt groups one at a time (relax_rollout.streaming)
            from relax_rollout.streaming import GroupStream

            self._stream = GroupStream(self.steps, self.journal, self.steps.alive)
            try:
                self._stream.run(start_step)
            finally:
                self._stream = None
            return self.get_record().stats
        handoff: queue.Queue = queue.Queue(maxsize=1)
        failure: list[BaseException] = []

        def finisher() -> None:
            while (pending := handoff.get()) is not None:
                try:
                    self.steps.finish(pending)
                except BusClosed:
                    return
                except BaseException as exc:  # surfaced by the generating loop
                    failure.append(exc)
                    return

        thread = threading.Thread(target=finisher, name="rollout-finisher", daemon=True)
        thread.start()
        step = start_step
        try:
            while not failure:
                self.steps.admit(step)
                pending = self.steps.collect(step)
                while thread.is_alive():
                    self.steps.alive()  # (waiting for the previous batch's scoring and put)
                    try:
                        handoff.put(pending, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                step += 1
        except BusClosed:
            pass
        finally:
            try:
                handoff.put_nowait(None)
            except queue.Full:
                pass
        if failure:
            raise failure[0]
        return self.get_record().stats

    # -- journal (restart in place) ---------------------------------------------------------------
    def reset_journal(self) -> None:
        """A fresh run (or a global restart from a checkpoint): forget the previous process's batches."""
        self.journal.reset()

    def seed_journal(self, begun: dict[str, dict], next_step: int) -> None:
        """Resumed from a checkpoint with a bus snapshot: the steps before ``next_step`` are on the bus
        already (put by the previous run); record where each began, for later checkpoints and restarts."""
        self.journal.seed(begun, next_step, self.prompts.iterator.state_dict())

    def recover(self) -> int:
        """After the previous rollout process died: load the journal and return the first step that is
        not on the bus yet (its prompts come next, as they would have)."""
        got = self.journal.recover()
        if got.state is not None:
            self.prompts.iterator.load_state_dict(got.state)
        self.prompts.prompt_log = got.prompt_log
        return got.start

    def get_record(self) -> RolloutRecord:
        p = self.prompts
        stats = {
            **self.stats,
            "skipped_rows": len(p.skipped_rows),
            "reward": self.scorer.stats(),
            "skipped_examples": p.skipped_rows[:5] + p.bad_media[:5],
        }
        return RolloutRecord(stats, dict(self.weight_log), list(p.prompt_log))

    def get_spans(self) -> list[dict[str, Any]]:
        """The rollout's phases and, with an engine pool, each engine's life (joined, active, drained)."""
        spans = self.tracer.get_spans()
        if self.engine_service is not None and self.tracer.enabled:
            spans += self.engine_service.pool.membership.spans()
        return spans

    def engines(self) -> list[dict[str, Any]]:
        return (
            self.engine_service.pool.membership.members(include_removed=True) if self.engine_service else []
        )

    def close(self) -> None:
        if self.generation.agents is not None:
            self.generation.agents.close()
        if self.agent_server is not None:
            self.agent_server.close()
        self.scorer.close()  # (--reward-isolation process: its worker processes)
        self.weights.close()
        if self.engine_service is not None:
            self.engine_service.close()
        elif callable(
            close := getattr(self.generation.engine, "close", None)
        ):  # an engine owning processes (sglang)
            close()
        if getattr(self, "_gpus", None) is not None:  # the engines' GPUs, now free for another run
            import ray

            ray.util.remove_placement_group(self._gpus)
            self._gpus = None


def _agents(
    cfg: RelaxConfig, engine: RolloutEngine, tokenizer: Any, model_path: str, stats: dict[str, Any]
) -> tuple[AgentServer | None, AgentHost | None]:
    """--agent-path: the engine served to the agents, and what runs them (None, None without it)."""
    if not cfg.agent.agent_path:
        return None, None
    from relax_rollout.agents import AgentHost, AgentServer

    server = AgentServer(cfg, engine, tokenizer, model_path)
    return server, AgentHost(cfg, server.state, server.base_url, tokenizer, stats)


def _check_data(cfg: RelaxConfig, prompt_path: str) -> None:
    """The prompt file against the fingerprint the run recorded at its start (``relax_core.ownership``)."""
    from relax_core.ownership import check_data, fingerprint, read_record

    was = read_record(cfg.run.output_dir).get("data_fingerprint")
    if was is not None and os.path.exists(prompt_path):
        check_data(was, fingerprint(prompt_path), "this run", cfg.run.allow_data_change)
