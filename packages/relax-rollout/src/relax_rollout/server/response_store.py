"""What ``previous_response_id`` continues (OpenAI's Responses API, :mod:`.responses_routes`): each stored
response's conversation, bounded and expiring, held by the engine server."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from relax_rollout.server.protocol import NotFound

KEEP = 1024
"""Responses kept (the oldest go first)."""
TTL_S = 3600.0
"""How long one is kept."""


class ResponseStore:
    """Each stored response's conversation (chat messages, its own reply last) and tools, bounded and
    expiring: what ``previous_response_id`` continues."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, tuple[float, list[dict[str, Any]]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[rid] = (time.monotonic(), messages)
            while len(self._items) > KEEP:
                self._items.popitem(last=False)

    def get(self, rid: str) -> list[dict[str, Any]]:
        with self._lock:
            item = self._items.get(rid)
            if item is None or time.monotonic() - item[0] > TTL_S:
                self._items.pop(rid, None)
                raise NotFound(
                    f"previous_response_id {rid!r}: no such response here (expired, not stored or never made)"
                )
            return list(item[1])
