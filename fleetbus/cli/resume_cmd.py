"""``fleetbus resume SESSION --result CALL_ID JSON … --error CALL_ID MESSAGE …``:
give a paused reply the results of calls run outside the agent, then stream
the resumed reply; and :func:`resume_with`, which ``confirm`` sends its
answer with."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fleetbus.agents.serving.client import external_result
from fleetbus.cli._common import connect, run
from fleetbus.cli._store import find_agent
from fleetbus.cli.ask_cmd import converse
from fleetbus.errors import ConfigError
from fleetbus.protocol import ConfirmResult, ExternalResult

__all__ = ["cmd", "resume_with"]


def cmd(args: argparse.Namespace) -> int:
    """Give a paused reply the results of calls run outside the agent, then
    stream the resumed reply.

    Raises:
        ConfigError: no result given, a call given twice, or a result that
            is not JSON.
    """
    message = external_result(
        args.session,
        results=[(call_id, _json_value(call_id, text)) for call_id, text in args.result],
        errors=args.error,
        sender="cli",
    )
    return resume_with(args, message)


def resume_with(args: argparse.Namespace, message: ConfirmResult | ExternalResult) -> int:
    """Send a paused session's resume input to the agent that serves it
    (found in the session store unless ``--agent`` names it), then stream
    the resumed reply."""

    async def main() -> int:
        bus = await connect(args.nats, args.prefix)
        try:
            agent = await find_agent(bus, args.session, args.agent, args.store_wait)
        finally:
            await bus.close()
        return await converse(args, agent, args.session, message)

    return run(main())


def _json_value(call_id: str, text: str) -> Any:
    """The output of ``--result CALL_ID JSON``.

    Raises:
        ConfigError: the text is not JSON.
    """
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(
            f"--result {call_id}: the result is not JSON ({exc}); give a text as a JSON "
            f"string, in quotes: '{json.dumps(text[:40], ensure_ascii=False)}'"
        ) from None
