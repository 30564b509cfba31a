"""The rollout's side of delta sync to SGLang (``relax_rollout.engines.sglang.delta``), without a server: when a
version goes full, and what the loader's requests carry. (The real server: test_sglang_real_delta.py.)"""

from __future__ import annotations

import base64
import json
import pickle

import torch

from relax_rollout.engines.sglang.delta import LOADER, SGLangDeltas, loader_env
from relax_rollout.sglang_delta_loader import PREFIX


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"w{k}.weight", torch.randn(32, 32, generator=g)) for k in range(4)]


def _nudge(named, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(n, t + (torch.rand(t.shape, generator=g) < 0.01) * 0.1) for n, t in named]


def _bases(entries) -> set:
    return {h["base"] for h, _ in entries}


def test_a_new_engine_set_or_a_restarted_engine_gets_a_full_version_then_deltas():
    """An engine that joined (another set of URLs: elastic) or came back (``fresh``) holds no version of ours."""
    d = SGLangDeltas(bucket_bytes=4 << 10)
    w = _weights(0)
    assert _bases(d.entries(w, 1, ["http://a"])) == {None}  # the first: full
    w = _nudge(w, 1)
    assert _bases(d.entries(w, 2, ["http://a"])) == {1}  # then deltas on version 1
    w = _nudge(w, 2)
    assert _bases(d.entries(w, 3, ["http://a", "http://b"])) == {None}  # an engine joined: full
    w = _nudge(w, 3)
    assert _bases(d.entries(w, 4, ["http://a", "http://b"])) == {3}
    d.codec.ask_full()  # (what send does with a restarted engine waiting, or after a refusal)
    assert _bases(d.entries(_nudge(w, 4), 5, ["http://a", "http://b"])) == {None}


def test_a_request_carries_every_bucket_inline_with_its_header_and_no_version_label():
    d = SGLangDeltas(bucket_bytes=4 << 10)
    entries = d.entries(_weights(0), 1, ["http://a"])
    body = d.body(entries, "http://a", tp_size=2, flush=True)
    assert body["load_format"] == LOADER and "weight_version" not in body and not body["abort_all_requests"]
    assert len(body["serialized_named_tensors"]) == 2  # one per TP rank
    named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
    headers = [json.loads(n[len(PREFIX) :]) for n, _ in named]
    assert [h["index"] for h in headers] == list(range(len(entries))) and len(entries) >= 3
    assert all(h["report"] == d.report("http://a") for h in headers)
    assert "layouts" in headers[-1] and headers[-1]["full"] and "layouts" not in headers[0]
    assert all(t.dtype == torch.uint8 and not t.is_shared() for _, t in named)  # (bytes inline, no fd)


def test_sglangs_environment_gets_the_source_trees_of_a_checkout():
    env = loader_env({"SGLANG_USE_CPU_ENGINE": "1"})
    paths = env["PYTHONPATH"].split(":")
    assert any(p.endswith("relax-core/src") for p in paths) and any(
        p.endswith("relax-rollout/src") for p in paths
    )
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
