"""The fleet-native face: agents, sessions and replies as REST resources,
replies streamed as Server-Sent Events of fleetbus's own typed events.

Routes (all under ``/v1/fleet``; docs/gateway.md shows each with curl):

``GET /agents``, ``GET /agents/{agent}``
    the agents served (name, description, tools, replicas).
``POST /agents/{agent}/messages``
    ``{"content": "…" | [content blocks], "session": "name"?, "schema": {…}?,
    "stream": false}``: a reply, in a new session or the one named. Not
    streamed: ``{"session", "final", "pending"}``. Streamed: one SSE event
    per reply event (``event:`` its name, ``data:`` the protocol ``event``
    message), then ``final_answer`` (the protocol message, with ``pending``
    when the reply paused), or ``error``.
``GET /sessions``, ``GET /agents/{agent}/sessions``
    the caller's sessions, most recent first.
``GET /agents/{agent}/sessions/{session}``
    one session: status, memory, the reply in progress, the last answer.
``GET /agents/{agent}/sessions/{session}/journal``
    its journal, fact by fact.
``POST /agents/{agent}/sessions/{session}/confirm``
    ``{"allow": [call ids], "deny": […], "always": false, "edits": {call id:
    {input}}, "accept_rules": [rules], "stream": false}``: decide the calls a
    paused reply waits for and continue it.
``POST /agents/{agent}/sessions/{session}/results``
    ``{"results": {call id: output}, "errors": {call id: message}, "stream":
    false}``: the results of calls run outside the agent.
``POST /agents/{agent}/sessions/{session}/cancel``
    interrupt the reply running.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from fleetbus.agents.serving.client import confirm_result, external_result
from fleetbus.agents.serving.directory import AgentInfo
from fleetbus.agents.serving.facts import SessionRecord
from fleetbus.errors import ConfigError
from fleetbus.gateway._common import (
    SESSION_HEADER,
    Who,
    error_body,
    fleet,
    sse,
    sse_response,
    started,
)
from fleetbus.gateway.auth import Caller
from fleetbus.gateway.fleet import Ask, GatewayFleet
from fleetbus.protocol import ContentBlock, Event, UserRequest

__all__ = ["router"]

router = APIRouter(prefix="/v1/fleet", tags=["fleet"])

_MAX_CALLS = 100
_MAX_RULES = 20


class SendBody(BaseModel):
    """A message to an agent."""

    model_config = ConfigDict(extra="forbid")

    content: str | list[dict[str, Any]] = Field(
        description="text, or content blocks as the protocol spells them"
    )
    session: str | None = Field(
        default=None, description="the conversation; a new one if not given"
    )
    schema_: dict[str, Any] | None = Field(
        default=None, alias="schema", description="JSON Schema of the structured answer"
    )
    stream: bool = False


class ConfirmBody(BaseModel):
    """A decision on the calls a paused reply waits for."""

    model_config = ConfigDict(extra="forbid")

    allow: list[str] = Field(default_factory=list, max_length=_MAX_CALLS)
    deny: list[str] = Field(default_factory=list, max_length=_MAX_CALLS)
    always: bool = False
    edits: dict[str, dict[str, Any]] = Field(default_factory=dict, max_length=_MAX_CALLS)
    accept_rules: list[str] = Field(default_factory=list, max_length=_MAX_RULES)
    stream: bool = False


class ResultsBody(BaseModel):
    """Results of calls run outside the agent."""

    model_config = ConfigDict(extra="forbid")

    results: dict[str, Any] = Field(default_factory=dict, max_length=_MAX_CALLS)
    errors: dict[str, str] = Field(default_factory=dict, max_length=_MAX_CALLS)
    stream: bool = False


def _agent(info: AgentInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "description": info.description,
        "tools": [{"name": t.name, "description": t.description} for t in info.tools],
        "replicas": info.replicas,
    }


def _brief(record: SessionRecord) -> dict[str, Any]:
    return {
        "agent": record.agent,
        "session": record.session_id,
        "status": record.status,
        "messages": record.messages,
        "created_at": record.created_at.isoformat(),
        "updated_at": record.updated_at.isoformat(),
    }


@router.get("/agents", summary="The agents served")
async def list_agents(request: Request, who: Who) -> dict[str, Any]:
    return {"agents": [_agent(a) for a in await fleet(request).agents(who)]}


@router.get("/agents/{agent}", summary="One agent")
async def get_agent(agent: str, request: Request, who: Who) -> dict[str, Any]:
    return _agent(await fleet(request).agent(who, agent))


@router.get("/sessions", summary="The caller's sessions")
async def list_sessions(request: Request, who: Who) -> dict[str, Any]:
    return {"sessions": [_brief(r) for r in await fleet(request).sessions(who)]}


@router.get("/agents/{agent}/sessions", summary="The caller's sessions with one agent")
async def list_agent_sessions(agent: str, request: Request, who: Who) -> dict[str, Any]:
    return {"sessions": [_brief(r) for r in await fleet(request).sessions(who, agent)]}


@router.get("/agents/{agent}/sessions/{session}", summary="One session")
async def get_session(agent: str, session: str, request: Request, who: Who) -> dict[str, Any]:
    record = await fleet(request).session(who, agent, session)
    state = record.state
    return {
        **_brief(record),
        "final": record.final,
        "pending": [p.model_dump(mode="json") for p in state.reply.pending] if state.reply else [],
        "memory": state.model_dump(mode="json")["memory"],
        "state": state.model_dump(mode="json", exclude={"memory"}),
    }


@router.get("/agents/{agent}/sessions/{session}/journal", summary="One session's journal")
async def get_journal(agent: str, session: str, request: Request, who: Who) -> dict[str, Any]:
    facts = await fleet(request).history(who, agent, session)
    return {"facts": [f.model_dump(mode="json") for f in facts]}


@router.post(
    "/agents/{agent}/messages",
    summary="Send a message; the reply, streamed or not",
    response_model=None,
)
async def send(agent: str, body: SendBody, request: Request, who: Who) -> Response:
    service = fleet(request)
    service.check_agent(who, agent)
    session = service.session_id(who, body.session)
    try:
        content: str | list[ContentBlock] = (
            body.content
            if isinstance(body.content, str)
            else msgspec.convert(body.content, list[ContentBlock])
        )
    except msgspec.ValidationError as exc:
        raise ConfigError(f"content: {exc}") from None
    message = UserRequest(sender=who.user, session_id=session, content=content)
    return await _reply(service, who, agent, session, message, body.schema_, body.stream)


@router.post(
    "/agents/{agent}/sessions/{session}/confirm",
    summary="Decide the calls a paused reply waits for",
    response_model=None,
)
async def confirm(
    agent: str, session: str, body: ConfirmBody, request: Request, who: Who
) -> Response:
    service = fleet(request)
    service.check_session(who, session)
    message = confirm_result(
        session,
        allow=body.allow,
        deny=body.deny,
        always=body.always,
        edits=body.edits.items(),
        accept_rules=body.accept_rules,
        sender=who.user,
    )
    return await _reply(service, who, agent, session, message, None, body.stream)


@router.post(
    "/agents/{agent}/sessions/{session}/results",
    summary="Give the results of calls run outside the agent",
    response_model=None,
)
async def results(
    agent: str, session: str, body: ResultsBody, request: Request, who: Who
) -> Response:
    service = fleet(request)
    service.check_session(who, session)
    message = external_result(
        session, results=body.results.items(), errors=body.errors.items(), sender=who.user
    )
    return await _reply(service, who, agent, session, message, None, body.stream)


@router.post(
    "/agents/{agent}/sessions/{session}/cancel",
    summary="Interrupt the reply running",
    status_code=202,
)
async def cancel(agent: str, session: str, request: Request, who: Who) -> dict[str, Any]:
    await fleet(request).cancel(who, agent, session)
    return {"cancelled": True, "agent": agent, "session": session}


async def _reply(
    service: GatewayFleet,
    who: Caller,
    agent: str,
    session: str,
    message: Ask,
    schema: dict[str, Any] | None,
    stream: bool,
) -> Response:
    headers = {SESSION_HEADER: session}
    if not stream:
        reply = await service.reply(who, agent, session, message, schema=schema)
        return JSONResponse(
            {
                "agent": agent,
                "session": session,
                "final": msgspec.to_builtins(reply.final),
                "pending": [p.model_dump(mode="json") for p in reply.pending],
            },
            headers=headers,
        )
    items = await started(service.stream(who, agent, session, message, schema=schema))

    async def body() -> AsyncIterator[bytes]:
        try:
            async for item in items:
                if isinstance(item, Event):
                    yield sse(msgspec.to_builtins(item), event=item.event)
                    continue
                pending = (
                    await service.pending(agent, session)
                    if item.finished_reason == "paused"
                    else []
                )
                data = msgspec.to_builtins(item)
                data["pending"] = [p.model_dump(mode="json") for p in pending]
                yield sse(data, event="final_answer")
        except Exception as exc:  # the stream has begun: the error is its last event
            yield sse(error_body(exc)[1], event="error")

    return sse_response(body(), keepalive=service.settings.keepalive, headers=headers)
