"""``fleetbus ask --user ID`` names who asks in the request's metadata (the
key of a long-term memory kept per user)."""

from __future__ import annotations

from typing import Any

import pytest

from fleetbus.cli import ask_cmd, build_parser
from fleetbus.protocol import UserRequest


@pytest.mark.parametrize(("extra", "metadata"), [(["--user", "ann"], {"user_id": "ann"}), ([], {})])
def test_ask_sends_the_user_it_is_given(
    monkeypatch: pytest.MonkeyPatch, extra: list[str], metadata: dict[str, str]
) -> None:
    sent: list[UserRequest] = []

    async def converse(args: Any, agent: str, session: str, message: UserRequest) -> int:
        sent.append(message)
        return 0

    monkeypatch.setattr(ask_cmd, "converse", converse)
    args = build_parser().parse_args(["ask", "helper", "What is my name?", *extra])
    assert ask_cmd.cmd(args) == 0
    assert [(m.content, m.metadata) for m in sent] == [("What is my name?", metadata)]
