"""relax_app.ui.data's reading of a trajectory's tokens (the run directory's readers: test_server.py)."""

from __future__ import annotations

from relax_app.ui.data import token_kinds


def test_turns_are_the_runs_of_equal_mask_and_a_call_is_told_by_its_text_or_its_answer():
    pieces = [
        "7",
        "<|im_end|>",
        "\n<|im_start|>user\nwrong",
        "<|im_end|>",
        "calc: 2",
        "+3",
        "\n<|im_start|>tool\n5",
        "5",
    ]
    mask = [1, 1, 0, 0, 1, 1, 0, 1]
    assert token_kinds(pieces, mask) == ["gen", "gen", "obs", "obs", "call", "call", "tool", "gen"]
    xml = ["<function=calc>", "</function>", "<tool_response>\n5\n</tool_response>"]
    assert token_kinds(xml, [1, 1, 0]) == ["call", "call", "tool"]
    assert token_kinds(["a", "b"], [1.0, 1.0]) == ["gen", "gen"] and token_kinds([], []) == []


def test_metrics_are_read_on_from_where_the_last_read_stopped(tmp_path):
    """A torn last line waits for its newline; a file replaced by a shorter one (a run started over in the
    same directory) is read from its start."""
    import json

    from relax_app.ui.data import RunView

    path, view = tmp_path / "metrics.jsonl", RunView(tmp_path)
    line = lambda step: json.dumps({"step": step, "loss": float("nan")}) + "\n"  # noqa: E731
    path.write_text(line(1) + line(2) + '{"step": 3, "lo')
    assert [r["step"] for r in view.metrics()] == [1, 2] and view.metrics()[0]["loss"] is None
    with path.open("a") as f:
        f.write('ss": 0.5}\n' + line(4))
    assert [r["step"] for r in view.metrics(after=2)] == [3, 4]
    replaced = tmp_path / "new.jsonl"
    replaced.write_text(line(1))
    replaced.replace(path)
    assert [r["step"] for r in view.metrics()] == [1]
