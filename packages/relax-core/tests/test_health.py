"""The health manager's policy and heartbeat bookkeeping (pure Python: no Ray, explicit clocks)."""

from __future__ import annotations

from relax_core.health import HealthPolicy, Heartbeats


def _actions(policy: HealthPolicy) -> list[tuple[str, str, int]]:
    return [(e.role, e.action, e.attempt) for e in policy.events]


def test_restarts_in_place_up_to_the_bound_then_globally_then_stops():
    p = HealthPolicy(max_restarts_per_role=2, max_global_restarts=1)
    assert p.decide("rollout", "died").action == "restart"
    assert p.decide("rollout", "died").action == "restart"
    # another role has its own count
    assert p.decide("advantages", "died").action == "restart"
    ev = p.decide("rollout", "died again")
    assert (ev.action, ev.attempt, ev.reason) == ("global_restart", 1, "died again")
    assert p.per_role == {}  # a global restart resets every role's count
    assert p.decide("rollout", "x").action == "restart"
    assert p.decide("rollout", "x").action == "restart"
    ev = p.decide("rollout", "x")
    assert (ev.action, ev.attempt) == ("stop", 1)
    assert _actions(p) == [
        ("rollout", "restart", 1),
        ("rollout", "restart", 2),
        ("advantages", "restart", 1),
        ("rollout", "global_restart", 1),
        ("rollout", "restart", 1),
        ("rollout", "restart", 2),
        ("rollout", "stop", 1),
    ]


def test_zero_bounds():
    p = HealthPolicy(0, 1)
    assert p.decide("actor_fwd", "died").action == "global_restart"
    assert p.decide("actor_fwd", "died").action == "stop"
    p = HealthPolicy(0, 0)
    assert p.decide("actor", "died").action == "stop"


def test_no_in_place_restart_possible_goes_global():
    p = HealthPolicy(3, 1)
    ev = p.decide("actor", "died", in_place_possible=False)
    assert (ev.action, ev.attempt) == ("global_restart", 1)


def test_escalate_replaces_the_event_and_counts_no_second_in_place_try():
    p = HealthPolicy(2, 1)
    ev = p.decide("actor", "died")
    assert (ev.action, ev.attempt) == ("restart", 1)
    ev2 = p.escalate(ev, "3 trained samples are not in the last checkpoint")
    assert ev2.action == "global_restart" and ev2.role == "actor"
    assert "died" in ev2.reason and "in-place restart impossible: 3 trained samples" in ev2.reason
    assert p.events == [ev2]  # the in-place attempt that never happened is not on the record
    # with no global restart left, escalation stops the run
    p = HealthPolicy(2, 0)
    ev = p.decide("actor", "died")
    ev2 = p.escalate(ev, "no checkpoint")
    assert ev2.action == "stop" and p.events == [ev2]


def test_stop_reason_names_role_reason_and_flags():
    p = HealthPolicy(1, 1)
    assert [p.decide("actor_fwd", r).action for r in "abc"] == ["restart", "global_restart", "restart"]
    ev = p.decide("actor_fwd", "ActorDiedError: boom")
    assert ev.action == "stop"
    msg = p.stop_reason(ev)
    assert "'actor_fwd'" in msg and "ActorDiedError: boom" in msg
    assert "--max-restarts-per-role" in msg and "--max-global-restarts" in msg
    assert "1 in-place restart(s)" in msg and "1 global restart(s)" in msg


class Ref:
    """A stand-in for a Ray ObjectRef (hashable, compared by identity)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Ref({self.name})"


def test_heartbeat_due_respects_interval():
    hb = Heartbeats(interval_s=2.0, timeout_s=10.0)
    assert hb.due(100.0)  # never sent
    hb.sent("actor", Ref("a"), now=100.0)
    assert not hb.due(100.0) and not hb.due(101.9)
    assert hb.due(102.0) and hb.due(105.0)


def test_healthy_answers_are_not_reported_and_clear_the_pending_call():
    hb = Heartbeats(interval_s=1.0, timeout_s=5.0)
    a, b = Ref("a"), Ref("b")
    hb.sent("actor", a, 0.0)
    hb.sent("rollout", b, 0.0)
    out = hb.check({a, b}, {a: {"pid": 1, "age_s": 0.2}, b: {"pid": 2, "age_s": 4.9}}, now=1.0)
    assert out == []
    assert hb._pending == {}
    assert hb.check(set(), {}, now=100.0) == []  # nothing pending: nothing late


def test_a_silent_role_is_reported_after_the_timeout_only():
    hb = Heartbeats(interval_s=1.0, timeout_s=5.0)
    a, b = Ref("a"), Ref("b")
    hb.sent("advantages", a, 10.0)
    hb.sent("actor", b, 10.0)
    assert hb.check(set(), {}, now=14.9) == []
    # a second heartbeat round while one is outstanding keeps the first (its send time counts)
    hb.sent("advantages", Ref("a2"), 12.0)
    out = hb.check({b}, {b: {"age_s": 0.0}}, now=15.5)
    assert [r for r, _ in out] == ["advantages"]
    assert "no heartbeat answer for 6s" in out[0][1] and "--heartbeat-timeout-s 5" in out[0][1]
    assert hb.check(set(), {}, now=30.0) == []  # reported once


def test_a_stuck_loop_is_reported():
    hb = Heartbeats(interval_s=1.0, timeout_s=5.0)
    a = Ref("a")
    hb.sent("rollout", a, 0.0)
    out = hb.check({a}, {a: {"pid": 7, "age_s": 42.0}}, now=0.1)
    assert out == [("rollout", "no progress for 42s (--heartbeat-timeout-s 5)")]


def test_an_exception_answer_is_reported():
    hb = Heartbeats(interval_s=1.0, timeout_s=5.0)
    a, b = Ref("a"), Ref("b")
    hb.sent("actor_fwd", a, 0.0)
    hb.sent("actor", b, 0.0)
    out = hb.check({a, b}, {a: RuntimeError("actor died\nmore"), b: {"age_s": 1.0}}, now=0.5)
    assert len(out) == 1 and out[0][0] == "actor_fwd"
    # one line: the run's last line of stderr is the reason it stopped (a Ray death carries "\n\tip: ...")
    assert out[0][1] == "heartbeat failed: RuntimeError: actor died"


def test_forget_drops_the_pending_call():
    hb = Heartbeats(interval_s=1.0, timeout_s=5.0)
    hb.sent("actor", Ref("a"), 0.0)
    hb.forget("actor")
    hb.forget("nobody")
    assert hb.check(set(), {}, now=100.0) == []


def test_an_unfixable_fault_is_found_in_a_remote_traceback():
    """Ray hands an actor's failed ``__init__`` over as text only: the class is found by its last line."""
    from relax_core.health import unfixable
    from relax_core.ownership import DataChanged, SettingsChanged

    remote = RuntimeError(
        "The actor died because of an error raised in its creation task, ray::RolloutWorker.__init__()\n"
        '  File "worker.py", line 99, in __init__\n'
        "relax_core.ownership.DataChanged: this run trained on other data: train.jsonl changed"
    )
    assert unfixable(remote) == "DataChanged: this run trained on other data: train.jsonl changed"
    assert unfixable(SettingsChanged("--lora-alpha 8 -> 16")) == "SettingsChanged: --lora-alpha 8 -> 16"
    assert unfixable(DataChanged("x")) == "DataChanged: x"
    assert unfixable(RuntimeError("relax_core.ownership.DirectoryInUse: busy")) is None
    assert unfixable(ValueError("the actor died")) is None


def test_the_stall_watch_fails_a_run_whose_trainer_makes_no_step():
    """#57's deadlock beat its heartbeats at step 0 for good: the watch fails such a run, saying where it
    stands; a step, or a role restarting, starts its clock again; 0 never fires."""
    import time

    import pytest

    from relax_core.health import RunStalled, StallWatch

    watch = StallWatch(0.05)
    watch.check(0, False)
    time.sleep(0.03)
    watch.check(1, False)  # a step: the clock starts again
    time.sleep(0.03)
    watch.check(1, False)
    time.sleep(0.03)
    watch.check(1, True)  # a role restarting: again
    time.sleep(0.06)
    with pytest.raises(RunStalled, match=r"no step trained .* version 1; the bus holds 16"):
        watch.check(1, False, lambda: "the bus holds 16")
    restarted = StallWatch(0.05)  # a global restart blocks the driver: the first check after it sees
    restarted.check(1, False, restarts=0)  # one more health event, and the clock starts again
    time.sleep(0.06)
    restarted.check(1, False, restarts=1)
    time.sleep(0.03)
    restarted.check(1, False, restarts=1)
    never = StallWatch(0.0)
    never.check(0, False)
    time.sleep(0.01)
    never.check(0, False)


def test_a_ray_errors_reason_says_what_was_raised_not_only_where():
    """Ray's task error opens with where it ran (colour codes and all) and ends with what was raised: the
    one-line reason is the exception raised there, with where; an actor that died creating says its
    traceback's last line (before, both said only where — ``ray::RolloutWorker.run()()`` — and no cause)."""
    import traceback

    import ray.exceptions as rx

    from relax_core.health import first_line

    try:
        raise ValueError("reward function my_reward raised on sample 12: division by zero")
    except ValueError as cause:
        task = rx.RayTaskError(
            "RolloutWorker.run", traceback.format_exc(), cause, "ray::RolloutWorker.run()", 42, "10.77.0.2"
        ).as_instanceof_cause()
    said = first_line(task)
    assert said.startswith("ValueError: reward function my_reward raised on sample 12: division by zero")
    assert "ray::RolloutWorker.run()" in said and "\x1b" not in said and "\n" not in said
    died = RuntimeError(
        "The actor died because of an error raised in its creation task, ray::Actor.__init__()\n"
        '  File "actor.py", line 9, in __init__\n'
        "OSError: [Errno 28] No space left on device: '/ckpt'"
    )
    assert first_line(died).endswith(
        "ray::Actor.__init__(): OSError: [Errno 28] No space left on device: '/ckpt'"
    )
    assert first_line(ValueError("one\ntwo")) == "ValueError: one"  # (no traceback: the first line)
    assert first_line(ValueError("")) == "ValueError: "
