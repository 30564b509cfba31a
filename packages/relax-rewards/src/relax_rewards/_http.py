"""A tiny JSON-over-HTTP client with retries, on the standard library only.

Why not httpx / requests: relax-rewards is installed into every rollout worker and data tool; one
POST with retries does not justify a dependency. Retries cover what a busy reward server or judge
actually does: refused connections while it starts, 429 / 5xx under load, and read time-outs.
4xx other than 408 / 429 are the caller's bug and are not retried.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Protocol

__all__ = ["AsyncBatchMixin", "HTTPRewardError", "post_json"]

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class HTTPRewardError(RuntimeError):
    """The server could not be reached or kept failing after every retry."""


def post_json(
    url: str,
    payload: Any,
    *,
    timeout_s: float = 30.0,
    retries: int = 3,
    backoff_s: float = 0.5,
    headers: dict[str, str] | None = None,
) -> Any:
    """POST ``payload`` as JSON and return the decoded JSON reply, retrying transient failures.

    Waits ``backoff_s * 2**attempt`` between attempts (``retries`` retries after the first try).
    """
    body = json.dumps(payload).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    last: str = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        request = urllib.request.Request(url, data=body, headers=all_headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                return json.loads(reply.read().decode() or "null")
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code} from {url}: {exc.read()[:200].decode(errors='replace')}"
            if exc.code not in RETRY_STATUS:
                raise HTTPRewardError(last) from exc
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            last = f"cannot reach {url}: {getattr(exc, 'reason', exc)}"
        except ValueError as exc:
            raise HTTPRewardError(f"{url} did not return JSON: {exc}") from exc
    raise HTTPRewardError(f"{last} (gave up after {retries + 1} attempts)")


class _Reward(Protocol):
    """What :class:`AsyncBatchMixin` needs of the class it is mixed into: a synchronous ``__call__``."""

    def __call__(self, response: str, label: Any, metadata: dict | None = None) -> Any: ...


class AsyncBatchMixin:
    """``await reward.ascore_batch(responses, labels, metadatas)``: the async batch form of an
    I/O-bound reward — up to ``concurrency`` requests in flight, results in order, exceptions
    returned in place (as ``asyncio.gather(return_exceptions=True)`` does)."""

    async def ascore_batch(self: _Reward, responses, labels, metadatas=None, concurrency: int = 16) -> list:
        import asyncio

        metas = list(metadatas) if metadatas is not None else [None] * len(responses)
        gate = asyncio.Semaphore(concurrency)

        async def one(response, label, metadata):
            async with gate:
                return await asyncio.to_thread(self, response, label, metadata)

        return await asyncio.gather(
            *(one(r, lab, m) for r, lab, m in zip(responses, labels, metas)), return_exceptions=True
        )
