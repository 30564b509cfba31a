"""The span recorder and the Chrome-trace writer (no torch, no Ray)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from relax_core.trace import Tracer, chrome_trace, write_trace


def _span(role, name, start_ms, dur_ms, **args):
    return {
        "name": name,
        "role": role,
        "thread": "t",
        "start_ns": int(start_ms * 1e6),
        "dur_ns": int(dur_ms * 1e6),
        "args": args,
    }


def test_tracer_records_wall_clock_spans_with_args():
    t = Tracer("actor")
    before = time.time_ns()
    with t.span("train", step=3) as args:
        time.sleep(0.01)
        args["n"] = 16
    after = time.time_ns()
    (s,) = t.get_spans()
    assert (s["name"], s["role"], s["args"]) == ("train", "actor", {"step": 3, "n": 16})
    assert before <= s["start_ns"] <= s["start_ns"] + s["dur_ns"] <= after
    assert s["dur_ns"] >= 10_000_000
    assert s["thread"] == threading.current_thread().name


def test_span_of_a_failing_block_is_kept_and_the_error_propagates():
    t = Tracer("rollout")
    with pytest.raises(ZeroDivisionError), t.span("reward"):
        1 / 0  # noqa: B018
    assert [s["name"] for s in t.get_spans()] == ["reward"]


def test_spans_timed_elsewhere_are_added_with_their_lane_and_overlapping_ones_get_rows_of_their_own():
    """A streamed group generates across the engine's steps, begun on one thread and ended on another:
    its span is added from its two wall-clock ends, on the lane named for it."""
    t = Tracer("rollout")
    t.add("generate", 1_000_000, 5_000_000, "generate", step=0, group=0)
    t.add("generate", 2_000_000, 3_000_000, "generate", step=0, group=1)
    t.add("generate", 9_000_000, 8_000_000, "generate", step=1, group=0)  # (a clock step back: 0 long)
    a, b, c = t.get_spans()
    assert (a["thread"], a["start_ns"], a["dur_ns"], a["args"]) == (
        "generate",
        1_000_000,
        4_000_000,
        {"step": 0, "group": 0},
    )
    assert c["dur_ns"] == 0
    rows = {e["args"]["group"]: e["tid"] for e in chrome_trace([a, b])["traceEvents"] if e.get("ph") == "X"}
    assert rows[0] != rows[1]  # (overlapping spans of one lane never share a row)


def test_disabled_tracer_records_nothing():
    t = Tracer("actor", enabled=False)
    with t.span("train", step=0) as args:
        args["n"] = 1
    t.add("generate", 0, 10, "generate")
    assert t.get_spans() == []


def test_chrome_trace_format():
    spans = [
        _span("actor", "train", 100, 50, step=0),
        _span("rollout", "generate", 0, 120, step=1),
        _span("rollout", "reward", 90, 40, step=0),  # overlaps generate: a second lane
        _span("advantages", "advantages", 95, 2, n=16),
    ]
    trace = chrome_trace(spans, order=("rollout", "advantages", "actor"))
    json.dumps(trace)  # plain JSON
    events = trace["traceEvents"]
    meta = {(e["pid"], e["name"]): e["args"] for e in events if e["ph"] == "M"}
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    # data flows top to bottom: rollout, advantages, actor
    assert [names[p] for p in sorted(names)] == ["rollout", "advantages", "actor"]
    x = [e for e in events if e["ph"] == "X"]
    assert len(x) == 4
    for e in x:
        assert {"name", "ts", "dur", "pid", "tid", "args", "cat"} <= set(e)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and e["dur"] >= 0
        assert e["cat"] == names[e["pid"]]
        assert (e["pid"], "process_sort_index") in meta
    by_name = {e["name"]: e for e in x}
    assert by_name["generate"]["ts"] == 0.0 and by_name["generate"]["dur"] == 120_000.0  # µs from the origin
    assert by_name["train"]["ts"] == 100_000.0 and by_name["train"]["args"]["step"] == 0
    assert by_name["generate"]["tid"] != by_name["reward"]["tid"]  # overlapping spans never share a row
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(threads.values()) == ["actor", "advantages", "rollout", "rollout (2)"]
    assert trace["otherData"]["origin_unix_ns"] == 0


def test_lanes_never_cross():
    spans = [
        _span("r", f"s{i}", start, dur)
        for i, (start, dur) in enumerate([(0, 10), (5, 10), (10, 1), (12, 5), (14, 1), (20, 1), (0, 30)])
    ]
    x = [e for e in chrome_trace(spans)["traceEvents"] if e["ph"] == "X"]
    for a in x:
        for b in x:
            if a is not b and a["tid"] == b["tid"]:
                assert a["ts"] + a["dur"] <= b["ts"] or b["ts"] + b["dur"] <= a["ts"]


def test_rows_follow_the_given_role_order_and_any_other_role_comes_after_by_name(tmp_path):
    """No role names are built in: a role the registry adds (a critic, a judge) gets its row from the
    run's plan, and the merged file keeps the order the drivers list the roles in."""
    spans = [_span(r, "work", 0, 1) for r in ("actor", "judge", "critic", "rollout", "zeta", "alpha")]

    def rows(trace):
        names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
        return [names[p] for p in sorted(names)]

    assert rows(chrome_trace(spans, order=("rollout", "critic", "judge", "actor"))) == [
        *("rollout", "critic", "judge", "actor", "alpha", "zeta")
    ]
    in_plan_order = [_span(r, "work", 0, 1) for r in ("rollout", "critic", "actor", "critic")]
    written = json.loads(write_trace(tmp_path / "t.json", in_plan_order).read_text())
    assert rows(written) == ["rollout", "critic", "actor"]


def test_write_trace(tmp_path):
    path = write_trace(tmp_path / "sub" / "trace.json", [_span("actor", "train", 0, 1)])
    data = json.loads(path.read_text())
    assert [e["name"] for e in data["traceEvents"] if e["ph"] == "X"] == ["train"]
    assert json.loads(write_trace(tmp_path / "empty.json", []).read_text())["traceEvents"] == []


def test_spans_from_different_processes_line_up():
    """Wall-clock starts: a span recorded in another process sits inside the parent's span around it."""
    code = (
        "import json, time\n"
        "from relax_core.trace import Tracer\n"
        "t = Tracer('actor')\n"
        "with t.span('train'):\n"
        "    time.sleep(0.05)\n"
        "print(json.dumps(t.get_spans()))\n"
    )
    parent = Tracer("rollout")
    with parent.span("generate"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    child = json.loads(out.stdout)
    events = [e for e in chrome_trace(parent.get_spans() + child)["traceEvents"] if e["ph"] == "X"]
    gen, train = sorted(events, key=lambda e: e["name"])
    assert gen["name"] == "generate" and train["name"] == "train" and gen["pid"] != train["pid"]
    assert gen["ts"] <= train["ts"] and train["ts"] + train["dur"] <= gen["ts"] + gen["dur"]


def test_core_busy_share_counts_each_role_s_work_once_over_the_machine():
    """Two cores, 10 s from the first span to the last: the rollout generates 0–6 s in two overlapping group
    spans (one process: 6 s, not 8) and scores 5–7 s (overlaps its generation: 7 s in all); the trainer
    waits 0–4 s (not work) and trains 4–10 s. 13 role-seconds of 20 core-seconds."""
    from relax_core.trace import chrome_trace, core_busy_share

    s = 1_000_000_000

    def span(role, name, t0, t1):
        return {
            "name": name,
            "role": role,
            "thread": "t",
            "start_ns": t0 * s,
            "dur_ns": (t1 - t0) * s,
            "args": {},
        }

    trace = chrome_trace(
        [
            span("rollout", "generate", 0, 4),
            span("rollout", "generate", 2, 6),
            span("rollout", "reward", 5, 7),
            span("actor", "wait_for_data", 0, 4),
            span("actor", "train", 4, 10),
        ]
    )
    got = core_busy_share(trace, cores=2)
    assert got == {"role_s": 13.0, "wall_s": 10.0, "share": 0.65}
