"""What `relax plan` prints and draws from a simulated run: step time, throughput, idle shares, staleness,
sync, and the timeline as a picture; and the recommended split and staleness from a sweep of runs."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from relax_app.plan.config import PlanConfig
from relax_app.plan.engines import busy_seconds
from relax_app.plan.sim import Outcome, Simulation


@dataclass(frozen=True)
class Summary:
    """One simulated run in figures (the steady state: from the first trained step's end on)."""

    step_s: float
    samples_per_s: float
    rollout_idle: float
    train_idle: float
    staleness: dict[int, int]
    sync_s: float
    pause_s: float
    sync_gb: float

    def line(self) -> str:
        mean = sum(k * v for k, v in self.staleness.items()) / max(1, sum(self.staleness.values()))
        return (
            f"step {self.step_s:.1f} s · {self.samples_per_s:.1f} samples/s · idle: rollout "
            f"{self.rollout_idle:.0%}, train {self.train_idle:.0%} · staleness mean {mean:.2f} "
            f"{dict(sorted(self.staleness.items()))} · sync {self.sync_gb:.2f} GB in {self.sync_s:.2f} s, "
            f"engine pause {self.pause_s:.2f} s"
        )


def summarise(o: Outcome) -> Summary:
    start, end = o.step_ends[0], o.step_ends[-1]
    steps = len(o.step_ends) - 1
    wall = end - start
    engine_busy = sum(busy_seconds(e.busy, start, end) for e in o.engines)
    rollout_idle = 1 - engine_busy / (wall * len(o.engines))
    train = o.pools["train"]
    train_idle = 1 - busy_seconds([(a, b) for a, b, _ in train.busy], start, end) / wall
    if o.plan.run.get("mode") == "colocate":  # (the same devices generate, then train: idle when neither)
        rollout_idle = train_idle = rollout_idle - (1 - train_idle)
    syncs = [s for s in o.syncs if start <= s[0] <= end] or o.syncs
    pauses = [p for e in o.engines for p in e.pauses] or [0.0]
    return Summary(
        step_s=wall / steps,
        samples_per_s=steps * o.samples_per_step / wall,
        rollout_idle=max(0.0, rollout_idle),
        train_idle=max(0.0, train_idle),
        staleness=o.staleness,
        sync_s=statistics.mean(b - a for a, b, _ in syncs) if syncs else 0.0,
        pause_s=statistics.mean(pauses),
        sync_gb=statistics.mean(n for *_, n in syncs) / 1e9 if syncs else 0.0,
    )


def phases(o: Outcome) -> dict[str, float]:
    """Seconds a step of the steady state spends in each kind of work: ``generate`` (an engine's, on
    average), and each role's on its devices (``train``, ``actor_fwd``, ``reference``) — the columns
    publications break a step into (veRL's gen, old_log_prob, update_actor)."""
    start, end = o.step_ends[0], o.step_ends[-1]
    steps = len(o.step_ends) - 1
    out = {"generate": sum(busy_seconds(e.busy, start, end) for e in o.engines) / len(o.engines) / steps}
    for pool in o.pools.values():
        for a, b, what in pool.busy:
            out[what] = out.get(what, 0.0) + busy_seconds([(a, b)], start, end) / steps
    return out


def candidates(plan: PlanConfig) -> list[PlanConfig]:
    """The splits and staleness bounds the recommendation tries: rollout taking 1/4 to 3/4 of the devices
    (whole engines), staleness 0 to 2 (or the plan's), in the plan's mode and streaming setting."""
    c = plan.cluster
    total, tp = c.rollout_gpus + c.train_gpus, c.rollout_tp  # (role_gpus kept as they are)
    splits = sorted(
        {max(tp, min(total - 1, round(total * f / tp) * tp)) for f in (0.25, 0.375, 0.5, 0.625, 0.75)}
    )
    bounds = sorted({0, 1, 2, int(plan.run.get("max_staleness", 1) or 0)})
    out = []
    for r in splits:
        for s in bounds:
            cluster = c.model_copy(update={"rollout_gpus": r, "train_gpus": total - r})
            run = {**plan.run, "mode": "fully_async", "max_staleness": s}
            out.append(plan.model_copy(update={"cluster": cluster, "run": run}))
    return out


def recommend(plan: PlanConfig, steps: int = 4) -> tuple[list[tuple[PlanConfig, Summary]], list[str]]:
    """Every candidate simulated over ``steps`` steps, the fastest first; and why each one that could not
    run did not (a split whose engines cannot hold the model, a deadlock), one line each."""
    results, failed = [], []
    for cand in candidates(plan):
        short = cand.model_copy(update={"workload": cand.workload.model_copy(update={"steps": steps})})
        try:
            results.append((cand, summarise(Simulation(short).run())))
        except (RuntimeError, ValueError) as e:
            c = cand.cluster
            failed.append(
                f"rollout {c.rollout_gpus} / train {c.train_gpus}, staleness {cand.run['max_staleness']}: {e}"
            )
    return sorted(results, key=lambda r: -r[1].samples_per_s), failed


def draw_timeline(o: Outcome, path: str | Path, lanes: int = 12) -> Path:
    """The roles over time: the first ``lanes`` engines, the training devices (each role's work), syncs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"generate": "#2563eb", "load weights": "#f59e0b", "train": "#16a34a", "sync": "#9333ea"}
    rows: list[tuple[str, list[tuple[float, float, str]]]] = []
    for e in o.engines[:lanes]:
        spans = [(a, b, "generate") for a, b in e.busy]
        rows.append((f"engine {e.id}", spans))
    for name, pool in o.pools.items():
        rows.append((f"{name} ({pool.gpus} GPUs)", list(pool.busy)))
    rows.append(("weight sync", [(a, b, "sync") for a, b, _ in o.syncs]))
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.5))
    for y, (_, spans) in enumerate(rows):
        for a, b, what in spans:
            ax.barh(y, max(b - a, 1e-3), left=a, height=0.7, color=colours.get(what, "#0891b2"), linewidth=0)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    for t in o.step_ends:
        ax.axvline(t, color="#999", lw=0.5, ls=":")
    ax.set_xlabel("seconds (simulated); dotted: a trained step")
    ax.set_title(
        f"{o.plan.name}: {o.plan.run.get('mode', 'fully_async')} · {len(o.engines)} engines", fontsize=10
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), loc="lower right", fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def describe(plan: PlanConfig) -> str:
    c, w = plan.cluster, plan.workload
    mode = plan.run.get("mode", "fully_async")
    split = (
        f"{c.rollout_gpus + c.train_gpus} {c.device} shared"
        if mode == "colocate"
        else f"{c.rollout_gpus} {c.device} rollout (TP {c.rollout_tp}) + {c.train_gpus} train"
    )
    extra = [k for k in ("streaming_rollout", "partial_rollout", "weight_sync_delta") if plan.run.get(k)]
    lora = f", LoRA r{plan.run['lora_rank']}" if plan.run.get("lora_rank") else ""
    return (
        f"{mode}, {split}, max staleness {plan.run.get('max_staleness', '-')}"
        + (f", {', '.join(extra)}" if extra else "")
        + lora
        + f"; {w.prompts_per_step}x{w.samples_per_prompt} a step, responses {w.response.kind} mean "
        f"{w.response.mean:g} max {w.response.max}"
    )


def colocate_of(plan: PlanConfig) -> PlanConfig:
    """The same work in colocate mode on the same devices (the anchor of a speed-up), with the baseline's
    own settings (``baseline_run``) where it ran differently."""
    run = {
        k: v
        for k, v in plan.run.items()
        if k not in ("streaming_rollout", "partial_rollout", "max_staleness")
    }
    return plan.model_copy(update={"run": {**run, **plan.baseline_run, "mode": "colocate"}})


def compare(plan: PlanConfig) -> tuple[Summary, Summary, float]:
    """The plan and its colocate anchor simulated: both summaries and the speed-up (throughput ratio)."""
    mine, anchor = summarise(Simulation(plan).run()), summarise(Simulation(colocate_of(plan)).run())
    return mine, anchor, mine.samples_per_s / anchor.samples_per_s
