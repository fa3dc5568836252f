"""The bus's client parses message headers as nats-py does, only faster."""

from __future__ import annotations

import pytest
from nats.aio.client import Client

from fleetbus.bus._seam import Client as BusClient

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
def test_the_same_headers_as_nats_py(raw: bytes) -> None:
    assert BusClient._parse_header_lines(raw) == Client._parse_header_lines(raw)
