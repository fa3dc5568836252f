"""Pause and resume of one reply: a step's calls that wait for a person's
confirmation or for a result computed outside the agent, the ``confirm_result``
or ``external_result`` that answers them, and what a person decides with a
confirmation besides yes or no: the "always" decisions kept as permission
rules, an input changed before the call runs, rules accepted for the agent.

A ``confirm_result`` is checked whole before anything of it is applied: a
``call_id`` that waits for no confirmation, a call answered twice, edited
parameters that are not an object (or go with a denial), a rule that does
not parse — each ends the reply ``error`` with a sentence saying what is
wrong, and the reply stays paused, as it was, for a corrected answer.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import msgspec

from fleetbus.agents import events as ev
from fleetbus.agents._reply_scope import ReplyScope, tool_result
from fleetbus.agents._tool_running import ToolRunner
from fleetbus.agents.permissions import PermissionRule, parse_accepted, suggest_rules
from fleetbus.agents.state import PendingCall
from fleetbus.errors import ConfigError, FleetbusError
from fleetbus.protocol import (
    Confirmation,
    ConfirmResult,
    ExternalResult,
    FinalAnswer,
    ToolResultBlock,
    ToolUseBlock,
    new_id,
)

__all__ = ["EDITED_NOTE", "Resumer", "asked_call"]

logger = logging.getLogger(__name__)

EDITED_NOTE = "(The user changed the input of this call before allowing it; it ran as shown.)"
"""Put before the result of an edited call: the model sees why its call changed."""


def asked_call(pending: PendingCall) -> dict[str, Any]:
    """A call waiting for confirmation as the ``require_user_confirm`` event
    lists it: the pending call, and the rules that would allow calls like it."""
    return {
        **pending.model_dump(),
        "suggested_rules": suggest_rules(pending.tool_name, pending.parameters),
    }


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
            self.scope.event(ev.REQUIRE_USER_CONFIRM, calls=[asked_call(p) for p in confirm])
        if external:
            self.scope.event(
                ev.REQUIRE_EXTERNAL_EXECUTION, calls=[p.model_dump() for p in external]
            )
        names = ", ".join(f"{p.tool_name} ({p.kind})" for p in pending)
        return self.scope.finish("paused", f"Waiting before running: {names}.")

    async def resume(self, resume: ConfirmResult | ExternalResult) -> FinalAnswer | None:
        """Answer the pending calls from ``resume``; the reply's end, or ``None`` to go on."""
        name = self.settings.name
        pending = {p.call_id: p for p in self.reply.pending}
        uses = {
            p.call_id: ToolUseBlock(id=p.call_id, name=p.tool_name, input=p.parameters)
            for p in self.reply.pending
        }
        results: dict[str, ToolResultBlock] = {}
        matched = False
        if isinstance(resume, ConfirmResult):
            refused = await self._take_confirmations(resume.confirmations, pending, uses)
            if refused is not None:
                return refused
            for decision in resume.confirmations:
                asked = pending.pop(decision.call_id)
                matched = True
                if decision.always:
                    self._remember_decision(asked, decision.confirmed)
                use = uses[decision.call_id]
                if not decision.confirmed:
                    results[use.id] = tool_result(
                        use, "denied", "denied: the user refused this call."
                    )
                    continue
                edited = decision.parameters is not None
                answer = await self._allowed(use, pending, edited=edited)
                if answer is not None:
                    results[use.id] = answer
            if any(d.accept_rules for d in resume.confirmations):
                # Calls still waiting that a rule accepted now lets through.
                for other in [p for p in pending.values() if p.kind == "confirm"]:
                    check = self.state.permissions.check(other.tool_name, other.parameters)
                    if check.action == "allow":
                        del pending[other.call_id]
                        answer = await self._allowed(uses[other.call_id], pending, edited=False)
                        if answer is not None:
                            results[other.call_id] = answer
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

    async def _allowed(
        self, use: ToolUseBlock, pending: dict[str, PendingCall], *, edited: bool
    ) -> ToolResultBlock | None:
        """Run a call a person allowed: its result, or ``None`` when it now
        waits to be run outside the agent (put back in ``pending``)."""
        toolkit = self.settings.toolkit
        if edited:
            # The person's input is checked like any call: a deny rule still
            # holds, and the tool validates the arguments (the model sees why not).
            decision = self.state.permissions.check(use.name, use.input)
            if decision.action == "deny":
                rule = f" by the rule {decision.rule}" if decision.rule else ""
                return tool_result(
                    use, "denied", f"denied: the call as the user changed it is not allowed{rule}."
                )
        if toolkit is not None and toolkit.is_external(use.name):
            pending[use.id] = PendingCall(
                call_id=use.id, tool_name=use.name, parameters=use.input, kind="external"
            )
            return None
        result = await self.tools.run_tool(use)
        if edited:
            output = result.output
            text = (
                output
                if isinstance(output, str)
                else json.dumps(output, ensure_ascii=False, default=str)
            )
            result = msgspec.structs.replace(result, output=f"{EDITED_NOTE}\n{text}")
        return result

    async def _take_confirmations(
        self,
        confirmations: list[Confirmation],
        pending: dict[str, PendingCall],
        uses: dict[str, ToolUseBlock],
    ) -> FinalAnswer | None:
        """Check the confirmations whole, then keep the rules they accept and
        put the edited inputs in place (memory and ``uses``); the end of the
        reply when they cannot be taken (the reply stays paused)."""
        problem, accepted = self._check(confirmations, pending)
        if problem is not None:
            return self._refuse(problem)
        if accepted:
            book = self.settings.accepted_rules
            try:
                # Write-ahead: the agent keeps the rules before the call they
                # came with runs (a take-over answers the same message again).
                if book is not None:
                    await book.add(accepted)
            except FleetbusError as exc:
                return self._refuse(f"the accepted rules could not be kept ({exc})")
            self.state.permissions.accept(*accepted)
        edits = {
            c.call_id: c.parameters
            for c in confirmations
            if c.confirmed and c.parameters is not None
        }
        if edits:
            self._edit_memory(edits, pending, uses)
        return None

    def _check(
        self, confirmations: list[Confirmation], pending: dict[str, PendingCall]
    ) -> tuple[str | None, list[PermissionRule]]:
        """What is wrong with ``confirmations`` (``None``: nothing), and the rules they accept."""
        if not confirmations:
            return "the confirm_result names no call", []
        accepted: list[PermissionRule] = []
        seen: set[str] = set()
        for decision in confirmations:
            call_id = decision.call_id
            if call_id in seen:
                return f"the call {call_id!r} is answered twice", []
            seen.add(call_id)
            waiting = pending.get(call_id)
            if waiting is None or waiting.kind != "confirm":
                if waiting is None:
                    return f"no call {call_id!r} waits for a confirmation", []
                return f"the call {call_id!r} waits for an external result, not a confirmation", []
            parameters: Any = decision.parameters
            if parameters is not None and not decision.confirmed:
                return f"the call {call_id!r} is denied: only an allowed call is edited", []
            if parameters is not None and not isinstance(parameters, dict):
                kind = _json_kind(parameters)
                return f"the edited parameters of {call_id!r} must be a JSON object, not {kind}", []
            rules: Any = decision.accept_rules
            try:
                if not isinstance(rules, list):
                    raise ConfigError(
                        f"accept_rules is a list of rules, not {type(rules).__name__}"
                    )
                accepted += [r for r in parse_accepted(rules) if r not in accepted]
            except ConfigError as exc:
                return f"the rules accepted with {call_id!r}: {exc}", []
        return None, accepted

    def _waiting(self) -> str:
        confirm = [p for p in self.reply.pending if p.kind == "confirm"]
        return ", ".join(f"{p.call_id} ({p.tool_name})" for p in confirm) or "none"

    def _refuse(self, problem: str) -> FinalAnswer:
        """End this reply ``error``, the paused reply kept as it was."""
        text = f"Not resumed: {problem}. The reply still waits for: {self._waiting()}."
        logger.warning("%s: %s", self.settings.name, text)
        self.scope.event(ev.REPLY_END, finished_reason="error", content=text)
        return FinalAnswer(
            sender=self.settings.name,
            session_id=self.reply.session_id,
            call_id=self.reply.request_id or self.reply.reply_id,
            content=text,
            finished_reason="error",
        )

    def _edit_memory(
        self,
        edits: dict[str, dict[str, Any]],
        pending: dict[str, PendingCall],
        uses: dict[str, ToolUseBlock],
    ) -> None:
        """Put the edited inputs in the calls memory holds (what ran is what
        it records; the model's are kept in the message's metadata).

        Memory is otherwise only appended to, and the session store writes
        only what was appended: the message asking for the calls, and those
        after it, get new ids, so the store sees memory rewritten and stores
        it anew (a rare write, proportional to the memory)."""
        memory = self.state.memory
        for index in range(len(memory) - 1, -1, -1):
            message = memory[index]
            if message.role == "assistant" and edits.keys() & {u.id for u in message.tool_uses}:
                break
        else:  # not in memory (compressed away): the calls still run as edited
            index = len(memory)
        original = (
            dict(memory[index].metadata.get("edited_calls", {})) if index < len(memory) else {}
        )
        for call_id, parameters in edits.items():
            original.setdefault(call_id, pending[call_id].parameters)
            use = msgspec.structs.replace(uses[call_id], input=parameters)
            uses[call_id] = use
            pending[call_id] = pending[call_id].model_copy(update={"parameters": parameters})
            self.scope.event(
                ev.TOOL_CALL,
                call_id=call_id,
                tool_name=use.name,
                parameters=parameters,
                edited=True,
            )
        if index == len(memory):
            return
        asking = memory[index]
        content = [
            uses[block.id] if isinstance(block, ToolUseBlock) and block.id in edits else block
            for block in asking.content
        ]
        memory[index] = asking.model_copy(
            update={
                "msg_id": new_id(),
                "content": content,
                "metadata": {**asking.metadata, "edited_calls": original},
            }
        )
        for later in range(index + 1, len(memory)):
            memory[later] = memory[later].model_copy(update={"msg_id": new_id()})

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


def _json_kind(value: Any) -> str:
    """What a JSON value is, as a person says it."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    return "null" if value is None else f"a {type(value).__name__}"
