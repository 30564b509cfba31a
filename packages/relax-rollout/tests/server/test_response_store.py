"""The Responses API's stored conversations: bounded (the oldest go first) and expiring; a missing one is a
404 naming ``previous_response_id``."""

import pytest

from relax_rollout.server import response_store
from relax_rollout.server.protocol import NotFound


def test_the_store_is_bounded_and_expires(monkeypatch):
    monkeypatch.setattr(response_store, "KEEP", 2)
    now = [100.0]
    monkeypatch.setattr(response_store.time, "monotonic", lambda: now[0])
    store = response_store.ResponseStore()
    for rid in ("a", "b", "c"):
        store.put(rid, [{"role": "user", "content": rid}])
    with pytest.raises(NotFound, match="previous_response_id 'a'"):
        store.get("a")  # (the oldest, dropped for the third)
    assert store.get("c") == [{"role": "user", "content": "c"}]
    now[0] += response_store.TTL_S + 1
    with pytest.raises(NotFound, match="expired"):
        store.get("b")
