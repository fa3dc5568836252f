"""The plain client of ``bench/sim_llm.py``: the requests the game's agents
send, sent with ``openai.AsyncOpenAI`` straight to the llama.cpp servers.

One *conversation* is what one agent does in a round of
``examples/guess_two_thirds.py`` (its real-model prompt): the system prompt
of its background and the round's prompt, the ``calculator`` tool on offer
(its schema as fleetbus sends it), streamed with usage, the same
``max_tokens`` and temperature. When the answer calls the calculator (a
native tool call, or one written in the text as ``"expr": "…"``) the call
runs here and the conversation goes on as fleetbus's agent does it (the
assistant's tool call, then the ``tool`` message with its result), for at
most the template's ``max_iters`` (3) model calls; a text without a call is
the answer, read with the example's ``parse``.

:func:`converse_all` runs the conversations ``slots`` at a time per server,
each taken by the first free place and kept on its server (its later calls
find their prompt in that server's cache, as one client's would).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
from _sim_llm_servers import LlamaServer

from fleetbus.tools_workers.builtin import calculator

MAX_CALLS = 3
"""Model calls per conversation at most (the example's ``max_iters``)."""

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": calculator.name,
            "description": calculator.description,
            "parameters": calculator.parameters,
        },
    }
]

SDK_RETRIES = 3
"""The SDK's retries of a failed request, as fleetbus's OpenAI adapter has them
by default."""
RECONNECTS = 3
"""Times a call is sent again when the server closed its connection before
answering: llama-server now and then closes a keep-alive connection that
is used again right after a streamed answer, and this SDK does not retry
that one itself (fleetbus's model worker answers ``overloaded`` then, and
the agent's call is sent again)."""

_EXPR = re.compile(r'"expr"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Conversation:
    """One agent's round: its system prompt and the round's prompt."""

    agent: str
    system: str
    user: str


@dataclass
class Outcome:
    """How a conversation went."""

    server: str
    calls: int = 0
    tool_calls: int = 0
    answer: str | None = None
    value: float | None = None
    error: str | None = None
    reconnects: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0


@dataclass
class _Answer:
    text: str = ""
    expr: str | None = None
    usage: dict[str, int] = field(default_factory=dict)


async def _call(
    client: openai.AsyncOpenAI,
    model: str,
    messages: list[Any],
    max_tokens: int,
    temperature: float | None,
) -> _Answer:
    extra: dict[str, Any] = {} if temperature is None else {"temperature": temperature}
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    text: list[str] = []
    arguments: dict[int, list[str]] = {}
    answer = _Answer()
    async for chunk in stream:
        if chunk.usage is not None:
            answer.usage = {
                "completion": chunk.usage.completion_tokens,
                "prompt": chunk.usage.prompt_tokens,
            }
        for choice in chunk.choices:
            if choice.delta.content:
                text.append(choice.delta.content)
            for tc in choice.delta.tool_calls or []:
                if tc.function is not None and tc.function.arguments:
                    arguments.setdefault(tc.index, []).append(tc.function.arguments)
    answer.text = "".join(text)
    for parts in arguments.values():
        try:
            expr = json.loads("".join(parts)).get("expr")
        except (ValueError, AttributeError):
            continue
        if isinstance(expr, str):
            answer.expr = expr
            break
    if answer.expr is None:
        found = _EXPR.search(answer.text)
        if found:
            answer.expr = json.loads(f'"{found.group(1)}"')
    return answer


def _result(expr: str) -> str:
    try:
        return json.dumps(calculator.fn(expr))
    except Exception as exc:  # the tool's failure is what the model sees
        return f"error: {exc}"


async def converse(
    server: LlamaServer,
    client: openai.AsyncOpenAI,
    conversation: Conversation,
    parse: Callable[[str], float],
    max_tokens: int,
    temperature: float | None,
) -> Outcome:
    """One conversation on ``server``."""
    outcome = Outcome(server.name)
    messages: list[Any] = [
        {"role": "system", "content": conversation.system},
        {"role": "user", "content": conversation.user},
    ]
    try:
        for step in range(MAX_CALLS):
            for attempt in range(RECONNECTS + 1):
                try:
                    answer = await _call(client, server.alias, messages, max_tokens, temperature)
                    break
                except openai.APIConnectionError:
                    if attempt == RECONNECTS:
                        raise
                    outcome.reconnects += 1
            outcome.calls += 1
            outcome.completion_tokens += answer.usage.get("completion", 0)
            outcome.prompt_tokens += answer.usage.get("prompt", 0)
            if answer.expr is None or step == MAX_CALLS - 1:
                outcome.answer = answer.text
                break
            outcome.tool_calls += 1
            call_id = f"call_{outcome.calls}"
            arguments = json.dumps({"expr": answer.expr})
            messages += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": calculator.name, "arguments": arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call_id, "content": _result(answer.expr)},
            ]
    except openai.OpenAIError as exc:
        cause = f" ({exc.__cause__!r})" if exc.__cause__ is not None else ""
        outcome.error = f"{type(exc).__name__}: {exc}{cause}"[:300]
        return outcome
    if outcome.answer is not None:
        try:
            outcome.value = parse(outcome.answer)
        except ValueError as exc:
            outcome.error = f"not read: {exc}"[:300]
    return outcome


async def converse_all(
    servers: list[LlamaServer],
    conversations: list[Conversation],
    *,
    slots: int,
    parse: Callable[[str], float],
    max_tokens: int,
    temperature: float | None,
    timeout: float,
) -> tuple[float, list[Outcome]]:
    """Every conversation, ``slots`` at a time on each server; the seconds
    from the first request to the last answer, and the outcomes."""
    todo: Iterator[Conversation] = iter(conversations)
    outcomes: list[Outcome] = []

    async def place(server: LlamaServer, client: openai.AsyncOpenAI) -> None:
        for conversation in todo:  # shared: each free place takes the next
            outcomes.append(
                await converse(server, client, conversation, parse, max_tokens, temperature)
            )

    clients = [
        openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none", timeout=timeout, max_retries=0)
        for s in servers
    ]
    started = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as tg:
            for server, client in zip(servers, clients, strict=True):
                for _ in range(slots):
                    tg.create_task(place(server, client))
    finally:
        for client in clients:
            await client.close()
    return time.perf_counter() - started, outcomes
