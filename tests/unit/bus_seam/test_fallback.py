"""``fleetbus.bus._seam`` falls back to the public path, with one warning,
when an internal it needs is missing, and takes what
``FLEETBUS_PRIVATE_OFF`` leaves on.

Every path's internals are in nats-py 2.15 and later; before 2.15 nats-py
has no ``Client._parse_header_lines`` (it parses headers with
``email.parser``), so the ``headers`` path is not taken there, and not
warned about (the seam knows the version it came with).
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from fleetbus.bus import BusSettings, _seam
from fleetbus.bus._seam import (
    PATHS,
    Client,
    Path,
    check,
    give_place,
    take_place,
    unsubscribe_ahead,
)

LINE_PARSER = callable(getattr(NATS, "_parse_header_lines", None))
"""Whether the installed nats-py parses headers with ``_parse_header_lines`` (2.15+)."""

THERE: frozenset[Path] = frozenset(PATHS) if LINE_PARSER else frozenset(PATHS) - {"headers"}
"""The paths whose internals the installed nats-py and Python have."""


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "fleetbus.bus._seam" and r.levelno == logging.WARNING
    ]


def test_every_path_whose_internals_are_there_is_taken(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert check(BusSettings(private_off="")) == THERE
    assert _warnings(caplog) == []


def test_a_missing_nats_method_leaves_its_path_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(NATS, "_process_headers")
    monkeypatch.delattr(NATS, "_parse_header_lines", raising=LINE_PARSER)
    paths = check(BusSettings(private_off=""))
    assert paths == frozenset(PATHS) - {"route", "headers"}
    [warning] = _warnings(caplog)
    assert "Client._process_headers" in warning
    assert ("Client._parse_header_lines" in warning) == LINE_PARSER  # expected from 2.15


def test_a_changed_process_msg_leaves_the_route(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def _process_msg(self: NATS, sid: int, subject: bytes, data: bytes) -> None:
        return None

    monkeypatch.setattr(NATS, "_process_msg", _process_msg)
    assert check(BusSettings(private_off="")) == THERE - {"route"}
    [warning] = _warnings(caplog)
    assert "Client._process_msg(sid, subject, reply, data, headers)" in warning


def test_a_semaphore_without_its_fields_leaves_the_places(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Plain(asyncio.Semaphore):
        def __init__(self, value: int = 1) -> None:
            super().__init__(value)
            del self._waiters

    monkeypatch.setattr(asyncio, "Semaphore", Plain)
    assert check(BusSettings(private_off="")) == THERE - {"places"}
    [warning] = _warnings(caplog)
    assert "asyncio.Semaphore._waiters" in warning


def test_paths_turned_off_are_not_taken_and_not_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(NATS, "_parse_header_lines", raising=LINE_PARSER)
    assert check(BusSettings(private_off="route, publish_now, headers")) == frozenset(PATHS) - {
        "route",
        "publish_now",
        "headers",
    }
    assert check(BusSettings(private_off="all")) == frozenset()
    assert _warnings(caplog) == []


def test_without_the_publish_now_path_publish_now_declines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_seam, "AVAILABLE", frozenset(PATHS) - {"publish_now"})
    assert not Client().publish_now("a.subject", b"x")


async def test_without_the_headers_path_nats_py_parses_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    block = b"NATS/1.0\r\nName: value\r\n\r\n"
    monkeypatch.setattr(_seam, "AVAILABLE", frozenset(PATHS) - {"headers"})
    if LINE_PARSER:
        by_nats_py = {"parsed by": "nats-py"}
        monkeypatch.setattr(NATS, "_parse_header_lines", staticmethod(lambda raw: by_nats_py))
        assert await Client()._process_headers(block) == by_nats_py
    else:  # nats-py parses the block itself, with email.parser
        assert await Client()._process_headers(block) == {"Name": "value"}


def test_a_missing_send_unsubscribe_leaves_the_unsubscribe_path_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(NATS, "_send_unsubscribe")
    assert check(BusSettings(private_off="")) == THERE - {"unsubscribe"}
    [warning] = _warnings(caplog)
    assert "Client._send_unsubscribe" in warning


async def test_without_the_unsubscribe_path_nothing_is_sent_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_seam, "AVAILABLE", frozenset(PATHS) - {"unsubscribe"})
    sent: list[int] = []

    async def send_unsubscribe(self: NATS, sid: int, limit: int = 0) -> None:
        sent.append(sid)

    monkeypatch.setattr(NATS, "_send_unsubscribe", send_unsubscribe)
    client = Client()
    subscription = Subscription(client, id=7, subject="x")
    monkeypatch.setattr(NATS, "is_connected", property(lambda self: True))
    assert not await unsubscribe_ahead(client, subscription)
    monkeypatch.setattr(_seam, "AVAILABLE", frozenset(PATHS))
    assert await unsubscribe_ahead(client, subscription)
    assert sent == [7]


async def test_places_are_taken_and_given_back_as_acquire_and_release_do() -> None:
    limiter = asyncio.Semaphore(1)
    assert take_place(limiter)
    assert limiter.locked()
    assert not take_place(limiter)
    give_place(limiter)
    assert not limiter.locked()
    async with limiter:
        waiter = asyncio.create_task(limiter.acquire())
        await asyncio.sleep(0)
        assert not take_place(limiter)  # somebody waits: not ahead of it
    await waiter
    give_place(limiter)  # nobody waits: back by the field
    assert not limiter.locked()
