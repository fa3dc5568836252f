"""What a replica remembers of the leases released: only while their markers
may still be on the server, and only while no later write replaced them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest

from fleetbus.agents.serving import leases as leases_module
from fleetbus.agents.serving.leases import Leases
from fleetbus.bus import Bus
from fleetbus.bus.store import KeyValueStore


def _leases(monkeypatch: pytest.MonkeyPatch, *, expiring: bool) -> tuple[Leases, list[float]]:
    clock = [1000.0]
    monkeypatch.setattr(leases_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    bucket = cast(KeyValueStore, SimpleNamespace(expiring_markers=expiring))
    return Leases(cast(Bus, None), bucket, owner="a", ttl=10.0), clock


def test_a_release_is_forgotten_once_its_marker_has_surely_expired(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leases, clock = _leases(monkeypatch, expiring=True)
    leases.note_released("x.old", 5)
    clock[0] += leases._marker_gone - 1
    leases.note_released("x.young", 6)
    assert leases.released("x.old")
    assert leases.released("x.young")
    clock[0] += 2  # "x.old" is past its marker's life; noting another prunes it
    leases.note_released("x.new", None)
    assert not leases.released("x.old")
    assert leases.released("x.young")
    assert leases.released("x.new")
    assert leases._known_marker("x.young") == (6, True)
    assert leases._known_marker("x.new") is None  # released, its marker unknown
    assert not leases.released("x.young")  # asked for: forgotten


def test_where_markers_stay_releases_are_kept_up_to_a_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(leases_module, "_RELEASED_KEPT", 3)
    leases, clock = _leases(monkeypatch, expiring=False)
    for i in range(5):
        leases.note_released(f"x.{i}", i)
        clock[0] += 3600
    assert [leases.released(f"x.{i}") for i in range(5)] == [False, False, True, True, True]
    assert leases._known_marker("x.2") == (2, True)  # a marker that stays is always there


def test_a_later_write_replaces_a_release_and_an_earlier_one_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leases, _ = _leases(monkeypatch, expiring=True)
    leases.note_released("x.s", 10)
    leases.note_held("x.s", 9)  # heard late: the take before the release
    assert leases.released("x.s")
    leases.note_held("x.s", 11)
    assert not leases.released("x.s")
    leases.note_released("x.t", None)
    leases.note_held("x.t", 3)  # a release of unknown revision: any write replaces it
    assert not leases.released("x.t")
    leases.note_released("x.u", 4)
    leases.forget_released()
    assert not leases.released("x.u")


def test_a_release_noted_again_is_kept_by_its_later_note(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leases, clock = _leases(monkeypatch, expiring=True)
    gone = leases._marker_gone
    leases.note_released("x.a", 1)
    clock[0] += 0.1 * gone
    leases.note_released("x.b", 2)
    clock[0] += 0.3 * gone
    leases.note_released("x.c", None)
    clock[0] += 0.3 * gone
    leases.note_released("x.a", 7)  # taken and released again
    clock[0] += 0.45 * gone  # x.a's first note and x.b are past their markers' life, x.c not yet
    leases.note_released("x.d", 8)
    assert [leases.released(k) for k in ("x.a", "x.b", "x.c", "x.d")] == [True, False, True, True]
    assert leases._known_marker("x.a") == (7, True)  # the later note's
    assert leases._known_marker("x.c") is None  # released, its marker unknown


def test_a_release_noted_again_counts_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases_module, "_RELEASED_KEPT", 3)
    leases, clock = _leases(monkeypatch, expiring=False)
    for key, marker in [("x.0", 1), ("x.1", 2), ("x.0", 3), ("x.2", 4), ("x.0", 5)]:
        leases.note_released(key, marker)
        clock[0] += 1
    assert [leases.released(f"x.{i}") for i in range(3)] == [True, True, True]
    leases.note_released("x.3", 6)  # one too many: the oldest note still current goes
    assert [leases.released(f"x.{i}") for i in range(4)] == [True, False, True, True]
    assert leases._known_marker("x.0") == (5, True)


async def test_a_marker_is_trusted_for_its_ttl_from_before_its_release_was_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server stamps a marker after its release was sent and expires it
    a TTL later: within that TTL a take writes against it first (a guess
    that fails costs a second write), past it the lease is written as new."""
    leases, clock = _leases(monkeypatch, expiring=True)
    markers = iter(range(7, 100))

    async def purge(key: str, *, revision: int, ttl: float) -> int:
        assert ttl == leases.marker_life == leases_module._MARKER_TTL
        clock[0] += 2.0  # a slow answer: the marker was stamped meanwhile
        return next(markers)

    monkeypatch.setattr(leases.bucket, "purge", purge, raising=False)
    assert await leases.drop("x.young", 3) == 7
    assert await leases.drop("x.old", 4) == 8
    clock[0] += leases.marker_life - 4.5  # x.young: 0.5 s of its TTL left since it was sent
    assert leases._known_marker("x.young") == (7, True)
    clock[0] += 3.0  # x.old: 0.5 s past its TTL since it was sent
    assert leases._known_marker("x.old") == (8, False)


async def test_a_marker_lives_its_few_seconds_whatever_the_lease_ttl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A marker is there to be heard and written against by the next take
    soon after: its life does not grow with the lease's TTL, so the bucket
    and each replica's memory of releases hold seconds of releases."""
    clock = [1000.0]
    monkeypatch.setattr(leases_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    bucket = cast(KeyValueStore, SimpleNamespace(expiring_markers=True))
    leases = Leases(cast(Bus, None), bucket, owner="a", ttl=120.0)  # long replies
    asked: list[float] = []

    async def purge(key: str, *, revision: int, ttl: float) -> int:
        asked.append(ttl)
        return 9

    monkeypatch.setattr(leases.bucket, "purge", purge, raising=False)
    assert await leases.drop("x.s", 3) == 9
    assert asked == [leases_module._MARKER_TTL] == [leases.marker_life]
    clock[0] += leases._marker_gone + 0.1
    leases.note_released("x.t", 10)  # noting another forgets what has surely expired
    assert not leases.released("x.s")
