"""relax_core.net: the address a gloo group member binds (#40). Across nodes it is the namespace tests'
job (tests/test_netns_runs.py); here, what holds on any machine."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest

from relax_core import net


def test_the_route_to_loopback_leaves_from_loopback_and_lo_holds_it():
    assert net.route_address("127.0.0.1") == "127.0.0.1"
    assert net.interface_of("127.0.0.1") == "lo"
    assert net.interface_of("203.0.113.7") is None  # (TEST-NET-3: no interface here holds it)


def test_a_free_port_is_free_on_the_address_asked():
    port = net.free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # (free: binding it works)


def test_pin_gloo_interface_keeps_a_launchers_choice(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    assert net.pin_gloo_interface("127.0.0.1") == "eth9"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert net.pin_gloo_interface("127.0.0.1") == "lo"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_gloo_options_bind_the_routed_address():
    pytest.importorskip("torch")
    opts = net.gloo_options("127.0.0.1", timedelta(seconds=5))
    assert len(opts._devices) == 1 and opts._timeout == timedelta(seconds=5)
