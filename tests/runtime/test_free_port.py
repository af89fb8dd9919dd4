"""free_port picks a port a server may bind later, outside the range the kernel hands outgoing connections."""

from __future__ import annotations

import os
import socket
import time

import pytest

from services.runtime import processes
from services.runtime.processes import ephemeral_ports, free_port


@pytest.fixture(autouse=True)
def claims(tmp_path, monkeypatch):
    """A claims directory of the test's own: picks of other tests and launchers stay out of its way."""
    monkeypatch.setattr(processes, "PORT_CLAIMS", str(tmp_path / "claims"))
    return tmp_path / "claims"


def test_ports_come_from_outside_the_ephemeral_range_and_are_bindable():
    low, high = ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert all(not low <= p <= high and p >= processes.PICK_FLOOR for p in ports), (low, high, ports)
    assert len(set(ports)) > 40  # picked at random, not one port handed out again and again
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_listened_port_is_never_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # the random source offers the held port twice before another: the picker must skip it
        monkeypatch.setattr(processes, "ephemeral_ports", lambda: (taken + 2, 65535))
        monkeypatch.setattr(processes, "PICK_FLOOR", taken - 2000)
        monkeypatch.setattr(processes, "_pick", _Scripted([taken, taken, taken + 1]))
        assert free_port() == taken + 1


def test_a_port_another_launcher_picked_is_skipped_until_its_claim_is_stale(monkeypatch, claims):
    free = [free_port() for _ in range(2)]  # two ports nobody listens on, each claimed by that pick
    (claims / str(free[1])).unlink()  # free[1] unclaimed again; free[0] stands for another launcher's pick
    monkeypatch.setattr(processes, "_pick", _Scripted([free[0], free[1]]))
    assert free_port() == free[1]  # the fresh claim skipped
    stale = time.time() - processes.PORT_HOLD_S - 1
    os.utime(claims / str(free[0]), (stale, stale))
    monkeypatch.setattr(processes, "_pick", _Scripted([free[1], free[0]]))
    assert free_port() == free[0]  # free[1] is ours now; free[0]'s claim was stale and is taken over


def test_no_room_outside_the_range_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(processes, "ephemeral_ports", lambda: (1024, 65535))
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


class _Scripted:
    """A random source that returns the given ports in order (choice picks the first range)."""

    def __init__(self, ports: list[int]):
        self._ports = iter(ports)

    def choice(self, seq):
        return seq[0]

    def randint(self, a: int, b: int) -> int:
        return next(self._ports)
