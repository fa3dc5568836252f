"""The time stamps a journal entry carries, as the server writes them."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from fleetbus.bus.journal import _parse_time


@pytest.mark.parametrize(
    ("stamp", "when"),
    [
        ("2026-12-05T12:35:43.123456789Z", datetime(2026, 12, 5, 12, 35, 43, 123456, UTC)),
        ("2026-12-05T12:35:43.1Z", datetime(2026, 12, 5, 12, 35, 43, 100000, UTC)),
        ("2026-12-05T12:35:43Z", datetime(2026, 12, 5, 12, 35, 43, 0, UTC)),
        ("2026-12-05T12:35:43.5", datetime(2026, 12, 5, 12, 35, 43, 500000, UTC)),
    ],
)
def test_a_server_stamp_is_read_to_the_microsecond_in_utc(stamp: str, when: datetime) -> None:
    assert _parse_time(stamp) == when


def test_a_stamp_that_is_no_time_is_none() -> None:
    assert _parse_time("yesterday") is None
