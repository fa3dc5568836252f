"""``fleetbus confirm SESSION --allow … --deny … --edit CALL_ID JSON …
--accept-rules RULE …``: answer the tool calls a paused reply waits for,
then stream the resumed reply."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fleetbus.agents.serving.client import confirm_result
from fleetbus.cli.resume_cmd import resume_with
from fleetbus.errors import ConfigError

__all__ = ["cmd"]


def cmd(args: argparse.Namespace) -> int:
    """Confirm or deny pending calls (maybe edited, maybe accepting rules),
    then stream the resumed reply.

    Raises:
        ConfigError: no call named, a call both allowed and denied, an edit
            that is not a JSON object, or a rule that does not parse.
    """
    message = confirm_result(
        args.session,
        allow=args.allow,
        deny=args.deny,
        always=args.always,
        edits=[(call_id, _edited_parameters(call_id, text)) for call_id, text in args.edit],
        accept_rules=args.accept_rules,
        sender="cli",
    )
    return resume_with(args, message)


def _edited_parameters(call_id: str, text: str) -> dict[str, Any]:
    """The input of ``--edit CALL_ID JSON``.

    Raises:
        ConfigError: the text is not JSON, or not an object.
    """
    try:
        parameters = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--edit {call_id}: the parameters are not JSON ({exc})") from None
    if not isinstance(parameters, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean"}.get(
            type(parameters), "null" if parameters is None else "a number"
        )
        raise ConfigError(f"--edit {call_id}: the parameters must be a JSON object, not {kind}")
    return parameters
