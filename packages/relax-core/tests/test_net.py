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


def test_gloo_is_left_its_choice_on_one_machine_and_a_launchers_choice_is_kept(monkeypatch):
    """A loopback rendezvous pins nothing (a process-wide pin to ``lo`` would break a later group across
    nodes); a launcher's GLOO_SOCKET_IFNAME wins. Across nodes: tests/test_netns_runs.py."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert net.gloo_interface("127.0.0.1") is None
    assert net.pin_gloo_interface("127.0.0.1") is None and "GLOO_SOCKET_IFNAME" not in os.environ
    with net.gloo_bound_to_route("127.0.0.1"):
        assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    assert net.gloo_interface("127.0.0.1") is None
    assert net.pin_gloo_interface("127.0.0.1") == "eth9"


def test_gloo_options_bind_the_routed_address():
    pytest.importorskip("torch")
    opts = net.gloo_options("127.0.0.1", timedelta(seconds=5))
    assert len(opts._devices) == 1 and opts._timeout == timedelta(seconds=5)


def test_unpin_takes_back_only_what_pin_set(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(net, "gloo_interface", lambda peer: "eth7")  # (as across nodes)
    assert net.pin_gloo_interface("10.0.0.1") == "eth7" and os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    net.unpin_gloo_interface()
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")  # a launcher's: kept
    net.unpin_gloo_interface()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth9"
