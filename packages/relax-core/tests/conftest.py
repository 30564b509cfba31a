"""Shared fixtures for relax-core tests."""

import json

import pytest


@pytest.fixture
def write_jsonl(tmp_path):
    """Write rows (dicts, or raw strings for malformed lines) to a .jsonl file; returns its path."""

    def write(rows, name="prompts.jsonl"):
        path = tmp_path / name
        lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
        path.write_text("\n".join(lines) + "\n")
        return path

    return write
