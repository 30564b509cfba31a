"""The real engine server (``python -m relax_rollout.server``, a subprocess on 127.0.0.1) against requests
an attacker sends (issue 36): half-open connections do not shut out generation; integer fields out of range
and contradictory lengths are a 400 naming the field, not a 500 or a silently different request."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import pytest

pytestmark = pytest.mark.integration

GEN = {"input_ids": [3, 12, 4, 13], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def test_256_half_open_generate_requests_do_not_shut_out_generation(engine_server, call):
    """Before: each counted against --max-queued-requests (256) before its body arrived: every /generate
    got 503 for as long as they were held."""
    u = urlparse(engine_server)
    socks = []
    try:
        for _ in range(256):
            s = socket.create_connection((u.hostname, u.port), timeout=30)
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            s.sendall(b"Content-Length: 1000\r\n\r\n{")
            socks.append(s)
        time.sleep(0.5)
        code, out = call(engine_server, "/generate", GEN)
        assert code == 200 and len(out["output_ids"]) == 2, out
        assert call(engine_server, "/health")[0] == 200
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize(
    "sampling, field, says",
    [
        ({"stop_token_ids": [10**20]}, "sampling_params.stop_token_ids", "0..2**63-1"),
        ({"stop_token_ids": [-1]}, "sampling_params.stop_token_ids", "0..2**63-1"),
        ({"min_new_tokens": 5, "max_new_tokens": 2}, "sampling_params.min_new_tokens", "≤ max_new_tokens"),
    ],
)
def test_out_of_range_integers_are_a_400_naming_the_field(engine_server, call, sampling, field, says):
    code, out = call(engine_server, "/generate", {"input_ids": [3, 12], "sampling_params": sampling})
    assert code == 400, out
    assert field in out["message"] and says in out["message"], out
