"""Pause and resume of one reply: a step's calls that wait for a person's
confirmation or for a result computed outside the agent, the ``confirm_result``
or ``external_result`` that answers them, and the "always" decisions kept as
permission rules."""

from __future__ import annotations

import logging

from fleetbus.agents import events as ev
from fleetbus.agents._reply_scope import ReplyScope, tool_result
from fleetbus.agents._tool_running import ToolRunner
from fleetbus.agents.state import PendingCall
from fleetbus.protocol import (
    ConfirmResult,
    ExternalResult,
    FinalAnswer,
    ToolResultBlock,
    ToolUseBlock,
)

__all__ = ["Resumer"]

logger = logging.getLogger(__name__)


class Resumer:
    """Pauses one reply (``scope``) and resumes it; ``tools`` runs what was confirmed."""

    def __init__(self, scope: ReplyScope, tools: ToolRunner) -> None:
        self.scope = scope
        self.settings = scope.settings
        self.state = scope.state
        self.reply = scope.reply
        self.tools = tools

    def pause(self, pending: list[PendingCall]) -> FinalAnswer:
        """End the reply ``paused``, waiting for ``pending``."""
        self.reply.pending = pending
        confirm = [p for p in pending if p.kind == "confirm"]
        external = [p for p in pending if p.kind == "external"]
        if confirm:
            self.scope.event(ev.REQUIRE_USER_CONFIRM, calls=[p.model_dump() for p in confirm])
        if external:
            self.scope.event(
                ev.REQUIRE_EXTERNAL_EXECUTION, calls=[p.model_dump() for p in external]
            )
        names = ", ".join(f"{p.tool_name} ({p.kind})" for p in pending)
        return self.scope.finish("paused", f"Waiting before running: {names}.")

    async def resume(self, resume: ConfirmResult | ExternalResult) -> FinalAnswer | None:
        """Answer the pending calls from ``resume``; the reply's end, or ``None`` to go on."""
        name = self.settings.name
        toolkit = self.settings.toolkit
        pending = {p.call_id: p for p in self.reply.pending}
        uses = {
            p.call_id: ToolUseBlock(id=p.call_id, name=p.tool_name, input=p.parameters)
            for p in self.reply.pending
        }
        results: dict[str, ToolResultBlock] = {}
        matched = False
        if isinstance(resume, ConfirmResult):
            for decision in resume.confirmations:
                waiting = pending.get(decision.call_id)
                if waiting is None or waiting.kind != "confirm":
                    logger.warning("%s: nothing waits to confirm %s", name, decision.call_id)
                    continue
                matched = True
                if decision.always:
                    self._remember_decision(waiting, decision.confirmed)
                del pending[decision.call_id]
                use = uses[decision.call_id]
                if not decision.confirmed:
                    results[use.id] = tool_result(
                        use, "denied", "denied: the user refused this call."
                    )
                elif toolkit is not None and toolkit.is_external(use.name):
                    pending[use.id] = PendingCall(
                        call_id=use.id, tool_name=use.name, parameters=use.input, kind="external"
                    )
                else:
                    results[use.id] = await self.tools.run_tool(use)
        else:
            for output in resume.results:
                waiting = pending.get(output.call_id)
                if waiting is None or waiting.kind != "external":
                    logger.warning("%s: no external call %s waits", name, output.call_id)
                    continue
                matched = True
                del pending[output.call_id]
                use = uses[output.call_id]
                if output.status == "success":
                    results[use.id] = tool_result(use, "success", output.content)
                else:
                    detail = output.error_detail
                    text = f"{detail.code}: {detail.message}" if detail else output.status
                    results[use.id] = tool_result(use, output.status, text)
        self.reply.pending = list(pending.values())
        if not results and self.reply.pending:
            if not matched:
                logger.warning("%s: the resume message matched no pending call", name)
            return self.pause(self.reply.pending)
        ordered = [uses[c] for c in uses if c in results]
        ended = self.tools.record(ordered, results)
        if ended is not None:
            return ended
        if self.reply.pending:
            return self.pause(self.reply.pending)
        await self.scope.checkpoint()
        return None

    def _remember_decision(self, waiting: PendingCall, confirmed: bool) -> None:
        """``always``: a rule so that calls of this tool are not asked again."""
        permissions = self.state.permissions
        if not confirmed:
            permissions.deny(waiting.tool_name)
            return
        # Ask outranks allow, so the ask rule that named exactly this tool
        # gives way; a glob that also covers other tools stays and still asks.
        permissions.rules = [
            r
            for r in permissions.rules
            if not (r.action == "ask" and r.tool == waiting.tool_name and not r.params)
        ]
        permissions.allow(waiting.tool_name)
        if permissions.check(waiting.tool_name, waiting.parameters).action == "ask":
            logger.warning(
                "%s: 'always' for %s cannot lift the broader ask rule %s",
                self.settings.name,
                waiting.tool_name,
                waiting.rule,
            )
