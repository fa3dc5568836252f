"""The OpenAI-compatible face: ``GET /v1/models``, ``POST
/v1/chat/completions`` and ``POST /v1/responses`` (``GET
/v1/responses/{id}``), streamed and not.

``model`` names an agent. The agent's own tool calls run inside the fleet;
the client sees the answer and, streamed, the reasoning and the tool
progress as reasoning text (``delta.reasoning_content`` in chat chunks,
``response.reasoning_text.delta`` events in Responses), the only place the
formats give progress that is not a call for the client to run.

Conversations (docs/gateway.md):

- **Chat Completions** are stateless: without a conversation named, each
  request is a new session that receives the earlier turns of ``messages``
  as a transcript, then the last user message. Name a conversation with the
  ``X-Fleetbus-Session`` header (or the ``user`` field) and the session
  remembers: only the trailing user messages are sent. The answer names the
  session in the same header.
- **Responses**: ``previous_response_id`` continues the response's session,
  ``conversation`` names one (as the header does); neither: a new session.

A paused reply (a tool call to confirm, a result to give) is answered with
text saying what it waits for and where to answer; a next message of just
"yes" or "no" in the conversation allows or denies the calls waiting.
``response_format`` (chat) and ``text.format`` (Responses) of type
``json_schema`` or ``json_object`` ask the agent for structured output; the
answer's text is the object as JSON.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from fleetbus.agents import events as ev
from fleetbus.agents.serving.client import confirm_result
from fleetbus.errors import ConfigError
from fleetbus.gateway._common import (
    SESSION_HEADER,
    Who,
    answer_text,
    content_text,
    error_body,
    fleet,
    paused_note,
    sse,
    sse_response,
    started,
    usage,
    yes_or_no,
)
from fleetbus.gateway.auth import Caller
from fleetbus.gateway.fleet import Ask, GatewayFleet, NotFound, Reply
from fleetbus.protocol import (
    ContentBlock,
    DataBlock,
    Event,
    FinalAnswer,
    TextBlock,
    UserRequest,
    new_id,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])


# -- models ---------------------------------------------------------------------------------


def _model(name: str, description: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "fleetbus",
        "description": description,
    }


@router.get("/models", summary="The agents, as models")
async def list_models(request: Request, who: Who) -> dict[str, Any]:
    agents = await fleet(request).agents(who)
    return {"object": "list", "data": [_model(a.name, a.description) for a in agents]}


@router.get("/models/{model}", summary="One agent, as a model")
async def get_model(model: str, request: Request, who: Who) -> dict[str, Any]:
    info = await fleet(request).agent(who, model)
    return _model(info.name, info.description)


# -- what requests carry -------------------------------------------------------------------


class ChatRequest(BaseModel):
    """A chat completion request (the fields the gateway reads; others,
    sampling options among them, are the agent's to choose and ignored)."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    n: int = 1
    tools: list[dict[str, Any]] | None = None


class ResponsesRequest(BaseModel):
    """A Responses API request (the fields the gateway reads)."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


def _blocks(content: Any, where: str) -> list[ContentBlock]:
    """Content blocks from an OpenAI message's content (text, image parts).

    Raises:
        ConfigError: a part of another type.
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [TextBlock(text=content)] if content else []
    if not isinstance(content, list):
        raise ConfigError(f"{where}: content is a string or a list of parts")
    blocks: list[ContentBlock] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text"):
            blocks.append(TextBlock(text=str(part.get("text", ""))))
        elif kind in ("image_url", "input_image"):
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise ConfigError(f"{where}: an image part without a URL")
            media = url[5 : url.index(";")] if url.startswith("data:") and ";" in url else "image/*"
            blocks.append(DataBlock(url=url, media_type=media))
        else:
            raise ConfigError(
                f"{where}: a content part of type {kind!r}; the gateway takes text and images"
            )
    return blocks


def _schema(response_format: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """The output schema ``response_format`` (or ``text.format``) asks for.

    Raises:
        ConfigError: a format the gateway does not know.
    """
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        # Chat nests it under "json_schema"; Responses gives it flat.
        spec = response_format.get("json_schema", response_format)
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ConfigError(f"{where}: a json_schema format needs a 'schema' object")
        return schema
    raise ConfigError(f"{where}: unknown format type {kind!r}")


def _refuse_client_tools(tools: list[dict[str, Any]] | None) -> None:
    if tools:
        raise ConfigError(
            "tools: the agent's own tools run inside the fleet; a request cannot add tools"
        )


def _transcript(turns: list[tuple[str, list[ContentBlock]]]) -> list[ContentBlock]:
    """Earlier turns as one text block, for a session that does not know them."""
    lines = [f"{role}: {content_text(blocks)}" for role, blocks in turns]
    return [TextBlock(text="Earlier in this conversation:\n" + "\n".join(lines))]


async def _request(
    service: GatewayFleet,
    who: Caller,
    agent: str,
    session: str,
    named: bool,
    turns: list[tuple[str, list[ContentBlock]]],
) -> Ask:
    """The message to send: the trailing user turns (after the transcript of
    the earlier ones when the session is new), or the confirmation a plain
    yes or no answers to a paused reply."""
    last = len(turns)
    while last > 0 and turns[last - 1][0] == "user":
        last -= 1
    asked = [b for _, blocks in turns[last:] for b in blocks]
    if not asked:
        raise ConfigError("messages: the last message is not the user's")
    if named and len(asked) == 1 and isinstance(asked[0], TextBlock):
        answer = yes_or_no(asked[0].text)
        if answer is not None:
            waiting = [
                p.call_id for p in await service.pending(agent, session) if p.kind == "confirm"
            ]
            if waiting:
                return confirm_result(
                    session,
                    allow=waiting if answer else (),
                    deny=() if answer else waiting,
                    sender=who.user,
                )
    earlier = turns[:last] if not named else [t for t in turns[:last] if t[0] == "system"]
    content = [*_transcript(earlier), *asked] if earlier else asked
    return UserRequest(sender=who.user, session_id=session, content=content)


def _session(service: GatewayFleet, who: Caller, conversation: str | None) -> tuple[str, bool]:
    return service.session_id(who, conversation), conversation is not None


def _base_url(request: Request) -> str:
    base: str | None = request.app.state.public_url
    return base or str(request.base_url)


def _note(request: Request, agent: str, session: str, reply: Reply) -> str:
    if reply.final.finished_reason != "paused":
        return ""
    return paused_note(_base_url(request), agent, session, reply.pending)


def _whole(request: Request, agent: str, session: str, reply: Reply) -> tuple[str, str]:
    """``(text, reasoning)`` of a reply not streamed: the answer (and what a
    paused one waits for), and the model's thinking."""
    text = "\n\n".join(
        t for t in (answer_text(reply.final), _note(request, agent, session, reply)) if t
    )
    thinking = "".join(
        str(e.data.get("thinking", "")) for e in reply.events if e.event == ev.THINKING_DELTA
    )
    return text, thinking


def _fleetbus(agent: str, session: str, final: FinalAnswer) -> dict[str, Any]:
    return {"agent": agent, "session": session, "finished_reason": final.finished_reason}


# -- chat completions ----------------------------------------------------------------------

_FINISH = {"exceed_max_iters": "length", "guardrail_tripped": "content_filter"}


@router.post(
    "/chat/completions", summary="A reply of the agent named by 'model'", response_model=None
)
async def chat_completions(body: ChatRequest, request: Request, who: Who) -> Response:
    service = fleet(request)
    if body.n != 1:
        raise ConfigError("n: an agent gives one answer per request")
    _refuse_client_tools(body.tools)
    agent = service.check_agent(who, body.model)
    schema = _schema(body.response_format, "response_format")
    turns = [
        (str(m.get("role", "user")), _blocks(m.get("content"), f"messages[{i}]"))
        for i, m in enumerate(body.messages)
    ]
    conversation = request.headers.get(SESSION_HEADER) or body.user
    session, named = _session(service, who, conversation)
    message = await _request(service, who, agent, session, named, turns)
    headers = {SESSION_HEADER: session}
    completion_id = f"chatcmpl-{new_id()}"
    created = int(time.time())
    if not body.stream:
        reply = await service.reply(who, agent, session, message, schema=schema)
        text, thinking = _whole(request, agent, session, reply)
        used = usage(reply.events)
        choice_message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            choice_message["reasoning_content"] = thinking
        return JSONResponse(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": agent,
                "choices": [
                    {
                        "index": 0,
                        "message": choice_message,
                        "finish_reason": _FINISH.get(reply.final.finished_reason, "stop"),
                        "logprobs": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": used.input_tokens,
                    "completion_tokens": used.output_tokens,
                    "total_tokens": used.input_tokens + used.output_tokens,
                },
                "fleetbus": _fleetbus(agent, session, reply.final),
            },
            headers=headers,
        )

    include_usage = bool((body.stream_options or {}).get("include_usage"))

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse(
            {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": agent,
                "choices": [
                    {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                ],
            }
        )

    async def body_chunks(items: AsyncIterator[Event | FinalAnswer]) -> AsyncIterator[bytes]:
        yield chunk({"role": "assistant", "content": ""})
        events: list[Event] = []
        said = False
        async for item in items:
            if isinstance(item, Event):
                events.append(item)
                text, reasoning = _progress(item, structured=schema is not None)
                if text:
                    said = True
                    yield chunk({"content": text})
                if reasoning:
                    yield chunk({"reasoning_content": reasoning})
                continue
            reply = await _ended(service, agent, session, item, events)
            tail = "" if said and item.structured is None else answer_text(item)
            note = _note(request, agent, session, reply)
            rest = "\n\n".join(t for t in (tail, note) if t)
            if rest:
                yield chunk({"content": ("\n\n" if said and not tail else "") + rest})
            yield chunk({}, _FINISH.get(item.finished_reason, "stop"))
            if include_usage:
                used = usage(events)
                yield sse(
                    {
                        "id": completion_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": agent,
                        "choices": [],
                        "usage": {
                            "prompt_tokens": used.input_tokens,
                            "completion_tokens": used.output_tokens,
                            "total_tokens": used.input_tokens + used.output_tokens,
                        },
                    }
                )
        yield b"data: [DONE]\n\n"

    return await _streamed(
        request, service, who, agent, session, message, schema, body_chunks, headers
    )


def _progress(event: Event, *, structured: bool) -> tuple[str, str]:
    """``(text, reasoning)`` an event adds to a streamed answer. A structured
    answer's text comes whole at the end, not as the model writes it."""
    data = event.data
    match event.event:
        case ev.TEXT_DELTA if not structured:
            return str(data.get("text", "")), ""
        case ev.THINKING_DELTA:
            return "", str(data.get("thinking", ""))
        case ev.TOOL_CALL:
            return "", f"\n[calling {data.get('tool_name')}({_short(data.get('parameters'))})]\n"
        case ev.TOOL_RESULT:
            return "", f"[{data.get('tool_name')}: {data.get('status')}]\n"
    return "", ""


def _short(value: Any) -> str:
    text = msgspec.json.encode(value).decode() if value is not None else ""
    return text if len(text) <= 200 else text[:199] + "…"


async def _ended(
    service: GatewayFleet, agent: str, session: str, final: FinalAnswer, events: list[Event]
) -> Reply:
    pending = await service.pending(agent, session) if final.finished_reason == "paused" else []
    return Reply(final=final, events=events, pending=pending)


async def _streamed(
    request: Request,
    service: GatewayFleet,
    who: Caller,
    agent: str,
    session: str,
    message: Ask,
    schema: dict[str, Any] | None,
    render: Callable[[AsyncIterator[Event | FinalAnswer]], AsyncIterator[bytes]],
    headers: dict[str, str],
) -> Response:
    """The SSE response of a reply, rendered by ``render``; an error once the
    stream has begun is its last event."""
    items = await started(service.stream(who, agent, session, message, schema=schema))

    async def rendered() -> AsyncIterator[bytes]:
        try:
            async for piece in render(items):
                yield piece
        except Exception as exc:  # the stream has begun: the error is its last event
            detail = error_body(exc)[1]
            yield sse(detail, event="error")

    return sse_response(rendered(), keepalive=service.settings.keepalive, headers=headers)


# -- responses -----------------------------------------------------------------------------


def _response_id(agent: str, session: str, call_id: str | None) -> str:
    """A response's id: ``resp_<agent>.<session>.<call id>``, so that any
    replica finds its session again."""
    return f"resp_{agent}.{session}.{call_id or new_id()}"


def _parts(response_id: str) -> tuple[str, str, str]:
    """``(agent, session, call id)`` of a response id.

    Raises:
        NotFound: it is not one.
    """
    parts = response_id.removeprefix("resp_").split(".")
    if not response_id.startswith("resp_") or len(parts) != 3:
        raise NotFound(f"no response {response_id!r}")
    return parts[0], parts[1], parts[2]


def _input_turns(body: ResponsesRequest) -> list[tuple[str, list[ContentBlock]]]:
    if isinstance(body.input, str):
        return [("user", _blocks(body.input, "input"))]
    turns = []
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind != "message":
            raise ConfigError(
                f"input[{i}]: an item of type {kind!r}; the gateway takes messages "
                "(the agent's tools run inside the fleet)"
            )
        turns.append((str(item.get("role", "user")), _blocks(item.get("content"), f"input[{i}]")))
    return turns


def _response(
    response_id: str,
    agent: str,
    session: str,
    created: int,
    status: Literal["in_progress", "completed", "failed"],
    *,
    text: str = "",
    reasoning: str = "",
    final: FinalAnswer | None = None,
    events: list[Event] | None = None,
    previous: str | None = None,
) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if reasoning:
        output.append(
            {
                "type": "reasoning",
                "id": f"rs_{response_id}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
            }
        )
    if final is not None:
        output.append(_message_item(response_id, text))
    used = usage(events or [])
    metadata = {"fleetbus_agent": agent, "fleetbus_session": session}
    if final is not None:
        metadata["fleetbus_finished_reason"] = final.finished_reason
    error = None
    if final is not None and final.finished_reason == "error":
        # The reply ended in error (a model that failed…): its text says why.
        status = "failed"
        error = {"code": "server_error", "message": text or answer_text(final)}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": agent,
        "output": output,
        "error": error,
        "incomplete_details": None,
        "instructions": None,
        "metadata": metadata,
        "parallel_tool_calls": True,
        "previous_response_id": previous,
        "temperature": None,
        "top_p": None,
        "tool_choice": "auto",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "usage": {
            "input_tokens": used.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": used.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": used.input_tokens + used.output_tokens,
        }
        if final is not None
        else None,
    }


def _message_item(response_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{response_id}",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


@router.post("/responses", summary="A reply of the agent named by 'model'", response_model=None)
async def create_response(body: ResponsesRequest, request: Request, who: Who) -> Response:
    service = fleet(request)
    _refuse_client_tools(body.tools)
    agent = service.check_agent(who, body.model)
    schema = _schema((body.text or {}).get("format"), "text.format")
    conversation = body.conversation
    if isinstance(conversation, dict):
        conversation = str(conversation.get("id", ""))
    if body.previous_response_id:
        session = service.check_session(who, _parts(body.previous_response_id)[1])
        named = True
    else:
        session, named = _session(service, who, conversation or request.headers.get(SESSION_HEADER))
    turns = _input_turns(body)
    if body.instructions:
        turns.insert(0, ("system", [TextBlock(text=body.instructions)]))
    message = await _request(service, who, agent, session, named, turns)
    # The response's id names the request, whose answer carries its call id.
    message = msgspec.structs.replace(message, call_id=message.call_id or new_id())
    response_id = _response_id(agent, session, message.call_id)
    created = int(time.time())
    headers = {SESSION_HEADER: session}
    if not body.stream:
        reply = await service.reply(who, agent, session, message, schema=schema)
        text, reasoning = _whole(request, agent, session, reply)
        return JSONResponse(
            _response(
                response_id,
                agent,
                session,
                created,
                "completed",
                text=text,
                reasoning=reasoning,
                final=reply.final,
                events=reply.events,
                previous=body.previous_response_id,
            ),
            headers=headers,
        )

    async def body_events(items: AsyncIterator[Event | FinalAnswer]) -> AsyncIterator[bytes]:
        seq = 0

        def emit(kind: str, **data: Any) -> bytes:
            nonlocal seq
            seq += 1
            return sse({"type": kind, "sequence_number": seq - 1, **data}, event=kind)

        start = _response(
            response_id, agent, session, created, "in_progress", previous=body.previous_response_id
        )
        yield emit("response.created", response=start)
        yield emit("response.in_progress", response=start)
        item_id = f"msg_{response_id}"
        reasoning_id = f"rs_{response_id}"
        events: list[Event] = []
        text = reasoning = ""
        reasoning_open = message_open = False
        async for item in items:
            if isinstance(item, Event):
                events.append(item)
                said, thought = _progress(item, structured=schema is not None)
                if thought:
                    if not reasoning_open:
                        reasoning_open = True
                        yield emit(
                            "response.output_item.added",
                            output_index=0,
                            item={
                                "type": "reasoning",
                                "id": reasoning_id,
                                "summary": [],
                                "content": [],
                            },
                        )
                    reasoning += thought
                    yield emit(
                        "response.reasoning_text.delta",
                        item_id=reasoning_id,
                        output_index=0,
                        content_index=0,
                        delta=thought,
                    )
                if said:
                    if not message_open:
                        message_open = True
                        yield _open_message(emit, item_id, int(reasoning_open))
                    text += said
                    yield emit(
                        "response.output_text.delta",
                        item_id=item_id,
                        output_index=int(reasoning_open),
                        content_index=0,
                        delta=said,
                        logprobs=[],
                    )
                continue
            reply = await _ended(service, agent, session, item, events)
            tail = "" if text and item.structured is None else answer_text(item)
            note = _note(request, agent, session, reply)
            rest = "\n\n".join(t for t in (tail, note) if t)
            index = int(reasoning_open)
            if not message_open:
                yield _open_message(emit, item_id, index)
            if rest:
                rest = ("\n\n" if text and not tail else "") + rest
                text += rest
                yield emit(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    delta=rest,
                    logprobs=[],
                )
            part = {"type": "output_text", "text": text, "annotations": []}
            yield emit(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            yield emit(
                "response.content_part.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=part,
            )
            yield emit(
                "response.output_item.done",
                output_index=index,
                item=_message_item(response_id, text),
            )
            done = _response(
                response_id,
                agent,
                session,
                created,
                "completed",
                text=text,
                reasoning=reasoning,
                final=item,
                events=events,
                previous=body.previous_response_id,
            )
            ended = "response.failed" if done["status"] == "failed" else "response.completed"
            yield emit(ended, response=done)

    return await _streamed(
        request, service, who, agent, session, message, schema, body_events, headers
    )


def _open_message(emit: Callable[..., bytes], item_id: str, index: int) -> bytes:
    added = emit(
        "response.output_item.added",
        output_index=index,
        item={
            "type": "message",
            "id": item_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        },
    )
    part = emit(
        "response.content_part.added",
        item_id=item_id,
        output_index=index,
        content_index=0,
        part={"type": "output_text", "text": "", "annotations": []},
    )
    return added + part


@router.get(
    "/responses/{response_id}",
    summary="A response, while it is its session's last",
    response_model=None,
)
async def get_response(response_id: str, request: Request, who: Who) -> dict[str, Any]:
    service = fleet(request)
    agent, session, call_id = _parts(response_id)
    record = await service.session(who, agent, session)
    final = record.final or {}
    if final.get("call_id") == call_id:
        answer = msgspec.convert(final, FinalAnswer)
        return _response(
            response_id,
            record.agent,
            session,
            int(record.updated_at.timestamp()),
            "completed",
            text=answer_text(answer),
            final=answer,
        )
    raise NotFound(f"no response {response_id!r} (only a session's last response is kept)")
