"""The bus's client parses message headers as nats-py does, only faster.

nats-py 2.15 and later parse a message's header block with
``Client._parse_header_lines``, which the seam's ``headers`` path overrides.
Earlier versions parse it with ``email.parser`` inside ``_process_headers``:
there is nothing to override, the seam leaves the path off (without a
warning: nothing is missing that should be there), and the bus's client gets
nats-py's own parse.
"""

from __future__ import annotations

import logging

import pytest
from nats.aio.client import Client

from fleetbus.bus import BusSettings
from fleetbus.bus._seam import Client as BusClient
from fleetbus.bus._seam import check, header_value

LINE_PARSER = callable(getattr(Client, "_parse_header_lines", None))
"""Whether the installed nats-py parses headers with ``_parse_header_lines`` (2.15+)."""

BLOCKS = [
    b"",
    b"\r\n",
    # what the server republishes for a lease write
    b"Nats-Stream: KV_fleet_session_leases\r\nNats-Subject: $KV.fleet_session_leases.a.s\r\n"
    b"Nats-Sequence: 123456\r\nNats-Time-Stamp: 2026-12-02T00:45:19.123456789Z\r\n"
    b"Nats-Last-Sequence: 123400\r\nKV-Operation: PURGE\r\nNats-TTL: 60\r\n\r\n",
    b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n\r\n",
    b"Name:Value\r\nTabbed:\tvalue\t\r\nSpaced  :  value  \r\n",
    b"no colon here\r\nGood: yes\r\n",
    b"Bad Name: dropped\r\nBad\x1cName: dropped\r\n: empty name\r\n",
    "Ünicode-Name: dropped\r\nValue: caf\u00e9 \u2603\r\n".encode(),
    b"Broken: \xff\xfe value\r\nTruncated: \xe2\x98\r\n",
    b"Repeated: one\r\nRepeated: two\r\n",
    b"Colons: a:b:c\r\nEmpty:\r\n",
    b"Control\x01Name: kept\r\nLone\nLinefeed: inside\r\n",
]


@pytest.mark.parametrize("raw", BLOCKS)
async def test_the_same_headers_as_nats_py(raw: bytes) -> None:
    """What the read loop makes of a message's header block: the seam's
    parse where nats-py has a line parser, nats-py's own before."""
    block = b"NATS/1.0\r\n" + raw
    assert await BusClient()._process_headers(block) == await Client()._process_headers(block)


@pytest.mark.parametrize("raw", BLOCKS)
async def test_one_header_read_from_the_block_is_the_parsed_one(raw: bytes) -> None:
    """``header_value`` (what a lease write's follower reads of the seven
    headers each comes with) gives what nats-py's parse does for every name
    written once, at the start of its line, as the server writes them."""
    block = b"NATS/1.0\r\n" + raw
    parsed = await Client()._process_headers(block) or {}
    lines = block.split(b"\r\n")
    for name, value in parsed.items():
        written = [line for line in lines if line.startswith(name.encode() + b":")]
        if len(written) == 1:
            assert header_value(block, name) == value, name
    assert header_value(block, "Not-There") is None


def test_the_headers_path_is_taken_where_nats_py_has_a_line_parser(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert ("headers" in check(BusSettings(private_off=""))) == LINE_PARSER
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "fleetbus.bus._seam" and r.levelno == logging.WARNING
    ]
    assert warnings == []
