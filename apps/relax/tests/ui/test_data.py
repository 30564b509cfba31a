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
