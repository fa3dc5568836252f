"""Test doubles that users need too.

:class:`ScriptedModel` replays model turns you give it and records every
request, so an agent can be tested without a network or an API key::

    model = ScriptedModel([
        ScriptedModel.call("calculator", {"expr": "2 + 2"}),
        ScriptedModel.text("It is 4."),
    ])
    answer = await Agent("a", "You add.", model, toolkit=kit).reply("2 + 2?")
    assert model.requests[1].messages[-1].role == "tool"
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fleetbus.models.model import (
    ModelError,
    ModelRequest,
    ModelResponse,
    ModelStreamItem,
    TextDelta,
    ThinkingDelta,
)
from fleetbus.protocol import (
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Usage,
    new_id,
)

__all__ = ["ScriptedModel", "Turn"]

Turn = ModelResponse | str | BaseException | Callable[[ModelRequest], "ModelResponse | str"]
"""One scripted model turn: a response, a text answer, an exception to
raise, or a function of the request returning one of the first two."""


class ScriptedModel:
    """A model that answers with the turns it was given, in order.

    Args:
        turns: the turns to replay.
        name: the model's name.
        chunk_size: stream text and thinking in pieces of this many characters.
        repeat_last: when the turns run out, repeat the last one instead of
            raising :class:`~fleetbus.models.model.ModelError`.

    Attributes:
        requests: every request received, in order.
    """

    def __init__(
        self,
        turns: Iterable[Turn] = (),
        *,
        name: str = "scripted",
        chunk_size: int = 8,
        repeat_last: bool = False,
    ) -> None:
        self._turns = list(turns)
        self._name = name
        self._chunk_size = max(1, chunk_size)
        self._repeat_last = repeat_last
        self._next = 0
        self.requests: list[ModelRequest] = []

    @property
    def name(self) -> str:
        """The model's name."""
        return self._name

    @property
    def remaining(self) -> int:
        """Turns not yet played."""
        return len(self._turns) - self._next

    def add(self, *turns: Turn) -> None:
        """Append turns to the script."""
        self._turns.extend(turns)

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        """Play the next turn, streaming its text and thinking in chunks.

        Raises:
            ModelError: the script has no turn left (or scripts a failure).
        """
        self.requests.append(request)
        if self._next >= len(self._turns):
            if not (self._repeat_last and self._turns):
                raise ModelError(
                    f"ScriptedModel {self._name!r} ran out of turns "
                    f"after {len(self._turns)} (request #{len(self.requests)})",
                    retryable=False,
                )
            turn = self._turns[-1]
        else:
            turn = self._turns[self._next]
            self._next += 1
        if callable(turn) and not isinstance(turn, BaseException | ModelResponse):
            turn = turn(request)
        if isinstance(turn, BaseException):
            raise turn
        response = ScriptedModel.text(turn) if isinstance(turn, str) else turn
        for block in response.content:
            if isinstance(block, ThinkingBlock):
                for piece in _chunks(block.thinking, self._chunk_size):
                    yield ThinkingDelta(piece)
            elif isinstance(block, TextBlock):
                for piece in _chunks(block.text, self._chunk_size):
                    yield TextDelta(piece)
        if response.usage is None:
            response = ModelResponse(
                content=response.content,
                usage=Usage(
                    input_tokens=_estimate(request),
                    output_tokens=max(1, len(json.dumps(_plain(response))) // 4),
                ),
                finish_reason=response.finish_reason,
                model=response.model or self._name,
            )
        yield response

    @staticmethod
    def text(text: str, *, thinking: str | None = None) -> ModelResponse:
        """A turn that answers with text (and, optionally, reasoning first)."""
        content: list[Any] = [ThinkingBlock(thinking=thinking)] if thinking else []
        content.append(TextBlock(text=text))
        return ModelResponse(content=content, finish_reason="stop")

    @staticmethod
    def call(
        tool_name: str,
        arguments: dict[str, Any] | str | None = None,
        *,
        call_id: str | None = None,
        text: str = "",
        thinking: str | None = None,
    ) -> ModelResponse:
        """A turn that calls one tool.

        ``arguments`` as a string stands for what a model wrote that is not a
        JSON object: it is parsed like an adapter would, and kept raw when it
        does not parse.
        """
        return ScriptedModel.calls((tool_name, arguments, call_id), text=text, thinking=thinking)

    @staticmethod
    def calls(
        *calls: tuple[str, dict[str, Any] | str | None]
        | tuple[str, dict[str, Any] | str | None, str | None],
        text: str = "",
        thinking: str | None = None,
    ) -> ModelResponse:
        """A turn that calls several tools at once: ``(name, arguments[, call_id])``."""
        content: list[Any] = []
        if thinking:
            content.append(ThinkingBlock(thinking=thinking))
        if text:
            content.append(TextBlock(text=text))
        for item in calls:
            name, arguments = item[0], item[1]
            call_id = item[2] if len(item) > 2 else None
            content.append(_tool_use(name, arguments, call_id or f"call_{new_id()[:12]}"))
        return ModelResponse(content=content, finish_reason="tool_calls")


def _tool_use(name: str, arguments: dict[str, Any] | str | None, call_id: str) -> ToolUseBlock:
    if arguments is None:
        return ToolUseBlock(id=call_id, name=name, input={})
    if isinstance(arguments, dict):
        return ToolUseBlock(id=call_id, name=name, input=arguments)
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        return ToolUseBlock(id=call_id, name=name, input=parsed)
    return ToolUseBlock(id=call_id, name=name, input={}, raw_arguments=arguments)


def _chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or []


def _plain(response: ModelResponse) -> list[str]:
    return [repr(block) for block in response.content]


def _estimate(request: ModelRequest) -> int:
    size = sum(len(repr(m.content)) for m in request.messages)
    size += sum(len(json.dumps(t.parameters)) + len(t.description) for t in request.tools)
    return max(1, size // 4)
