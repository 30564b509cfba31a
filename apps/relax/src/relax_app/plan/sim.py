"""The discrete-event simulation behind `relax plan`: the run's own scheduling code on a virtual clock.

What is real: the run's :class:`~relax_core.config.RelaxConfig` (from the plan's ``run`` settings), its roles
and bus (:class:`~relax_core.roles.RolePlan`, a :class:`~relax_bus.DataBus` on a
:class:`~relax_bus.state.ManualClock`): the staleness bound's admission (``bus.admit``) and the engines'
fresh-enough weights (:class:`~relax_bus.staleness.StalenessBound`), each consumer's dispatch (its sampler,
the fields it waits for), the trainer's request (:func:`relax_train.roles.actor_step.take_request`),
streaming's groups in flight (:func:`relax_rollout.streaming.inflight_limit`, ``room_for_step``), partial
rollout (:func:`relax_rollout.streaming.update_waits_for_responses`) and delta sync's full-version schedule
(:class:`relax_core.weight_delta.DeltaSender`). What is simulated: the engines and the trainer's devices
(:mod:`relax_app.plan.engines`, :mod:`relax_app.plan.costs`). ``tests/test_architecture.py`` checks these
are the real objects, not copies.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_app.cli_config import config_from_flat
from relax_app.plan.config import PlanConfig
from relax_app.plan.costs import Costs
from relax_app.plan.engines import Engine, Request, lengths
from relax_bus import BusTimeout, DataBus
from relax_bus.staleness import StalenessBound
from relax_bus.state import ManualClock
from relax_core import sample
from relax_core.roles import RolePlan
from relax_core.roofline import ModelShape
from relax_core.weight_delta import DeltaSender
from relax_rollout.streaming import inflight_limit, room_for_step, update_waits_for_responses
from relax_train.roles.actor_step import take_request

CONSUMER_BATCH = 64
"""Samples a consumer loop asks for at once (``relax_train.roles.base.BusLoop.batch_size``)."""
_NO_TOKENS = np.zeros(1, np.int32)
MAX_RUNNING = 1024
"""Requests an engine runs at once at most (SGLang's ``--max-running-requests`` order of magnitude)."""


@dataclass
class Pool:
    """Devices that run one piece of work at a time (a role's, or several roles' taking turns)."""

    name: str
    gpus: int
    free_at: float = 0.0
    busy: list[tuple[float, float, str]] = field(default_factory=list)

    def run(self, now: float, seconds: float, what: str) -> float:
        start = max(now, self.free_at)
        self.free_at = start + seconds
        self.busy.append((start, self.free_at, what))
        return self.free_at


class ReadyCount:
    """Samples that carry every field the trainer ``needs``, by step: the trainer asks the bus only once its
    step could be whole (each ask scans what the bus holds, and the simulation asks after every change)."""

    def __init__(self, needs: set[str]) -> None:
        self.needs = needs
        self.steps: dict[int, int] = {}
        self._fields: dict[int, tuple[int, set[str]]] = {}
        """Sample id -> (its step, the fields it carries) until it carries all."""

    def wrote(self, ids: list[int], fields: set[str], step: int | None = None) -> None:
        """``fields`` were written on samples ``ids`` (put: with their ``step``)."""
        for i in ids:
            at, have = self._fields.setdefault(i, (step if step is not None else -1, set()))
            have |= fields
            if self.needs <= have:
                self.steps[at] = self.steps.get(at, 0) + 1
                del self._fields[i]


@dataclass
class Outcome:
    """What one simulated run did (times in virtual seconds)."""

    plan: PlanConfig
    step_ends: list[float]
    samples_per_step: int
    engines: list[Engine]
    pools: dict[str, Pool]
    syncs: list[tuple[float, float, float]]
    """(start, end, bytes) of each weight sync."""
    staleness: dict[int, int]
    events: int


class Simulation:
    """One plan's run: call :meth:`run`."""

    def __init__(self, plan: PlanConfig) -> None:
        self.plan = plan
        w, c = plan.workload, plan.cluster
        flat = {
            "hf_checkpoint": "(simulated)",
            "prompt_data": "(simulated)",
            "rollout_batch_size": w.prompts_per_step,
            "n_samples_per_prompt": w.samples_per_prompt,
            "rollout_max_response_len": w.response.max,
            "num_rollout": w.steps,
            **plan.run,
        }
        self.cfg = config_from_flat(flat)
        self.colocate = self.cfg.run.mode == "colocate"
        self.roles = RolePlan.from_config(self.cfg)
        self.clock = ManualClock()
        self.bus = DataBus(self.roles.bus_config(), clock=self.clock)
        self.bound = StalenessBound(self.cfg.run.max_staleness, self.cfg.run.staleness_policy)
        shape = ModelShape.from_hf_config(plan.model)
        self.costs = Costs(
            shape,
            c.spec(),
            plan.efficiency,
            dtype_bytes=plan.dtype_bytes,
            tied_embeddings=bool(plan.model.get("tie_word_embeddings")),
        )
        total = c.devices
        rollout_gpus = total if self.colocate else c.rollout_gpus
        per_request = w.prompt_total + min(w.response.mean, w.response.max)
        cap = min(MAX_RUNNING, max(1, int(self.costs.kv_capacity_tokens(c.rollout_tp) // per_request)))
        static = c.engine == "torch" and not self.cfg.rollout.streaming_rollout
        self.engines = [
            Engine(i, c.rollout_tp, self.costs, cap, static=static)
            for i in range(rollout_gpus // c.rollout_tp)
        ]
        self.pools = {"train": Pool("train", total if self.colocate else c.train_gpus)}
        if not self.colocate:  # (consumer roles with devices of their own; the others share "train")
            self.pools.update({r: Pool(r, n) for r, n in c.role_gpus.items() if n})
        self.delta = (
            DeltaSender(full_every=self.cfg.run.weight_sync_full_every)
            if self.cfg.run.weight_sync_delta
            else None
        )
        self.streaming = self.cfg.rollout.streaming_rollout
        self.limit = inflight_limit(self.cfg) if self.streaming else 0
        self.in_place = not update_waits_for_responses(self.cfg)
        self.rng = np.random.default_rng(w.seed)
        self.now, self.events, self._seq = 0.0, 0, itertools.count()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self.next_step = 0
        self.generating: int | None = None
        """Batch mode: the step whose batch is generating (the next begins when it ends)."""
        self.groups: dict[tuple[int, int], list[Request]] = {}
        self.inflight = 0
        self.left: dict[int, int] = {}
        """Step -> responses not ended yet."""
        self.trainer_step = 0
        self.training = False
        self.busy_roles: set[str] = set()
        self.step_ends: list[float] = []
        self.syncs: list[tuple[float, float, float]] = []
        self.sync_free = 0.0
        self.dirty = True
        """Something a role waits for changed since the roles last asked."""
        self.ready = ReadyCount(set(self.roles.roles[self.roles.trainer].needs))
        self.waiting_puts: list[tuple[list[list[Request]], int]] = []
        self.scored: set[tuple[int, int]] = set()

    # -- the event loop -------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def run(self, max_events: int = 5_000_000) -> Outcome:
        steps = self.plan.workload.steps
        self.pump()
        while self._heap and len(self.step_ends) < steps:
            t, _, fn = heapq.heappop(self._heap)
            if t > self.now:
                self.clock.advance(t - self.now)
                self.now = t
            fn()
            if self.dirty:  # (only what changes the bus, a role's devices or a weight version re-asks)
                self.pump()
            self.events += 1
            if self.events > max_events:
                raise RuntimeError(
                    f"the simulation ran past {max_events} events at step {len(self.step_ends)}"
                )
        if len(self.step_ends) < steps:
            raise RuntimeError(
                f"the simulated run stopped at step {len(self.step_ends)} of {steps} with nothing left to do: "
                "a role waits for something no other role will produce (the run's settings deadlock)"
            )
        for e in self.engines:
            e.close(self.now)
        hist = {int(k): int(v) for k, v in self.bus.stats().get("staleness_hist", {}).items()}
        return Outcome(
            self.plan,
            self.step_ends,
            self.cfg.samples_per_rollout,
            self.engines,
            self.pools,
            self.syncs,
            hist,
            self.events,
        )

    def pump(self) -> None:
        """Every role does what it can now (each asks the bus without waiting: ``timeout=0``)."""
        self.dirty = False
        self._puts()
        self._rollout()
        self._consumers()
        self._trainer()

    # -- rollout ----------------------------------------------------------------------------------------
    def _admitted(self, step: int) -> bool:
        """The bus admits ``step`` (the staleness bound) and the engines hold fresh-enough weights; colocate
        generates a step once the one before it is trained (``relax_core.colocate``'s order)."""
        if self.colocate and (self.training or self.trainer_step < step):
            return False
        try:
            self.bus.admit(step, timeout=0)
        except BusTimeout:
            return False
        need = self.bound.admit_version(step)
        return all(e.version >= need for e in self.engines)

    def _rollout(self) -> None:
        groups = self.cfg.rollout.rollout_batch_size
        while self.next_step < self.plan.workload.steps and self._admitted(self.next_step):
            if self.streaming and not room_for_step(self.inflight, groups, self.limit):
                return
            if not self.streaming and self.generating is not None:
                return
            self._begin(self.next_step)
            self.next_step += 1

    def _begin(self, step: int) -> None:
        w = self.plan.workload
        n, prompt = w.samples_per_prompt, w.prompt_total
        lens = lengths(self.rng, w.prompts_per_step * n, w.response)
        self.left[step] = len(lens)
        self.generating = step
        self.inflight += w.prompts_per_step
        for g in range(w.prompts_per_step):
            reqs = [Request(step, g, j, prompt, int(lens[g * n + j])) for j in range(n)]
            self.groups[(step, g)] = reqs
            for r in reqs:
                e = min(self.engines, key=Engine.load)  # the least loaded engine (the pool's spread)
                e.queue.append(r)
        for e in self.engines:
            self._replan(e)

    def _replan(self, e: Engine) -> None:
        e.start_queued(self.now)
        e.ticket += 1
        end = e.next_end()
        if end is not None:
            ticket = e.ticket
            self.at(end, lambda: self._ended(e, ticket))

    def _ended(self, e: Engine, ticket: int) -> None:
        if ticket != e.ticket:
            return
        for r in e.finish(self.now):
            self._response_done(r)
        if not e.running and e.pending is not None:
            e.take_weights(self.now, *e.pending, in_place=True)
            self.dirty = True
        e.mark(self.now)
        self._replan(e)

    def _response_done(self, r: Request) -> None:
        self.left[r.step] -= 1
        group = self.groups[(r.step, r.group)]
        if self.streaming and all(x.done >= x.length for x in group) and (r.step, r.group) not in self.scored:
            self.scored.add((r.step, r.group))  # (several of its responses may end in one decode step)
            self._score([group], r.step)
        if self.left[r.step] == 0:
            if not self.streaming:
                self._score([g for (s, _), g in self.groups.items() if s == r.step], r.step)
                self.generating = None
                self.dirty = True

    def _score(self, groups: list[list[Request]], step: int) -> None:
        """Rewards (``reward_s`` a sample, ``reward_concurrency`` at once, beside generation), then the put."""
        n = sum(len(g) for g in groups)
        seconds = self.plan.workload.reward_s * n / max(1, self.cfg.rollout.reward_concurrency)
        self.at(self.now + seconds, lambda: self._put(groups, step))

    def _put(self, groups: list[list[Request]], step: int) -> None:
        self.dirty = True
        self.waiting_puts.append((groups, step))

    def _puts(self) -> None:
        """Put the scored groups waiting, in order, while the bus takes them (a full bus holds the producer
        back until consumers ack: its back-pressure)."""
        while self.waiting_puts:
            groups, step = self.waiting_puts[0]
            if not self._put_now(groups, step):
                return
            self.waiting_puts.pop(0)

    def _put_now(self, groups: list[list[Request]], step: int) -> bool:
        rows = []
        for g in groups:
            gid = f"{step}:{g[0].group}"
            for r in g:
                rows.append(
                    {
                        sample.GROUP_ID: gid,
                        sample.POLICY_VERSION: min(x.version or 0 for x in g),
                        sample.REWARD: 0.0,
                        sample.TOKENS: _NO_TOKENS,  # (what the rollout writes that roles wait for; its size is
                        sample.LOSS_MASK: _NO_TOKENS,  # the lengths below)
                        sample.PROMPT_LEN: r.prompt,
                        sample.RESPONSE_LEN: r.length,
                    }
                )
        try:
            ids = self.bus.put(rows, partition=f"step{step}", timeout=0)
        except BusTimeout:
            return False
        for g in groups:
            del self.groups[(step, g[0].group)]
        self.inflight -= len(groups)
        self.ready.wrote(ids, set(rows[0]), step)
        return True

    # -- consumers and the trainer ----------------------------------------------------------------
    def _consumers(self) -> None:
        for name in self.roles.loops:
            spec = self.roles.roles[name]
            pool = self.pools.get(name, self.pools["train"])
            if name in self.busy_roles or (spec.model is not None and pool.free_at > self.now):
                continue
            try:
                batch = self.bus.get(str(spec.consumer), n=CONSUMER_BATCH, partial=True, timeout=0)
            except BusTimeout:
                continue
            seqs = [
                int(p + r) for p, r in zip(batch.data[sample.PROMPT_LEN], batch.data[sample.RESPONSE_LEN])
            ]
            seconds = self.costs.forward_s(pool.gpus, seqs) if spec.model is not None else 0.0
            end = pool.run(self.now, seconds, name) if spec.model is not None else self.now
            self.busy_roles.add(name)
            self.at(end, functools.partial(self._consumed, name, spec, batch))

    def _consumed(self, name: str, spec: Any, batch: Any) -> None:
        self.dirty = True
        self.bus.add_fields(batch.ids, {f: [np.zeros(1, np.float32)] * len(batch.ids) for f in spec.writes})
        self.ready.wrote(batch.ids, set(spec.writes))
        self.bus.ack(spec.consumer, batch.lease_id)
        self.busy_roles.discard(name)

    def _trainer(self) -> None:
        pool = self.pools["train"]
        if self.training or pool.free_at > self.now or self.trainer_step >= self.plan.workload.steps:
            return
        consumer = str(self.roles.roles[self.roles.trainer].consumer)
        ask = take_request(self.cfg, self.trainer_step)
        if self.ready.steps.get(self.trainer_step, 0) < ask["n"]:
            return
        try:
            batch = self.bus.get(consumer, timeout=0, **ask)
        except BusTimeout:
            return
        seqs = [int(p + r) for p, r in zip(batch.data[sample.PROMPT_LEN], batch.data[sample.RESPONSE_LEN])]
        seconds = self.costs.train_s(pool.gpus, seqs)
        if self.colocate:
            seconds += self.costs.switch_s(pool.gpus)
        self.training = True
        end = pool.run(self.now, seconds, "train")
        self.at(end, lambda: self._trained(batch))

    def _trained(self, batch: Any) -> None:
        self.dirty = True
        self.bus.ack(str(self.roles.roles[self.roles.trainer].consumer), batch.lease_id)
        self.trainer_step += 1
        self.bus.set_trainer_version(self.trainer_step)
        self.step_ends.append(self.now)
        self.training = False
        self._publish(self.trainer_step)

    def _publish(self, version: int) -> None:
        """The new version to every engine: its bytes (full, LoRA's adapters, or a delta on the schedule)
        over the link (colocate: already on the devices), then each engine's load."""
        full = version_bytes(self.costs, self.cfg.lora.lora_rank)
        nbytes = full
        if self.delta is not None:
            is_full = self.delta.full_due()
            nbytes = full if is_full else full * self.plan.workload.delta_share
            self.delta.sent(version, is_full, int(nbytes), int(full))
        c = self.plan.cluster
        start = max(self.now, self.sync_free)
        wire = 0.0 if self.colocate else nbytes * 8 / (c.link_gbps * 1e9) + c.link_latency_s
        end = start + wire
        self.sync_free = end
        self.syncs.append((start, end, nbytes))
        self.at(end, lambda: self._arrive(version, full))

    def _arrive(self, version: int, nbytes: float) -> None:
        self.dirty = True
        for e in self.engines:
            if e.version < version:
                e.take_weights(self.now, version, nbytes, self.in_place)
                self._replan(e)


def version_bytes(costs: Costs, lora_rank: int) -> float:
    """A version's bytes: the whole model's, or with LoRA its adapters' (every linear layer, rank r)."""
    if not lora_rank:
        return costs.weight_bytes()
    s = costs.shape
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    mlp = (s.hidden + s.ffn) * 3 if not s.experts else (s.hidden + s.expert_ffn) * 3 * s.experts
    per_layer = (s.hidden + q) * 2 + (s.hidden + kv) * 2 + mlp
    return float(s.layers * per_layer * lora_rank * costs.dtype_bytes)
