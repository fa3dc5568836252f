"""Everything needed to continue an agent: its :class:`AgentState`.

The state is one pydantic model that round-trips through JSON: memory with
its marks, the compressed summary, the plan, the permission rules, the tool
groups the model switched on, and the
reply in progress — its step, its usage so far, and the tool calls it waits
for. An agent built from a restored state continues exactly where the other
stopped, in this process or another.

What every reasoning step needs of the whole memory — its chat form, its
token count, its tool call ids — is kept up to date by a :class:`MemoryIndex`
(:meth:`AgentState.memory_index`), so that a step costs the same at the tenth
message as at the thousandth; the index is derived data, never saved.
``bench/agent_loop.py`` (``memory``, ``ratio_1000_10``) measures that a step
does not grow with the conversation.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any, Literal

from pydantic import BaseModel, Field

from fleetbus.agents.compression import Summary, TokenCounter
from fleetbus.agents.messages import Msg
from fleetbus.agents.permissions import Permissions
from fleetbus.agents.plan import PlanNotebook
from fleetbus.protocol import ChatMessage, ToolUseBlock

__all__ = [
    "STATE_VERSION",
    "AgentState",
    "MemoryIndex",
    "PendingCall",
    "RecentCall",
    "ReplyEnding",
    "ReplyState",
]

STATE_VERSION = 1
"""Bumped when a saved state can no longer be read by this code."""


class PendingCall(BaseModel):
    """A tool call the reply waits for: a person's confirmation, or a result
    computed outside the agent."""

    call_id: str
    tool_name: str
    parameters: dict[str, Any]
    kind: Literal["confirm", "external"]
    rule: str | None = None
    """For ``confirm``: the rule that asked."""


class RecentCall(BaseModel):
    """One tool call of the reply, as loop detection remembers it."""

    signature: str
    """The tool's name and a digest of its canonical arguments (``name:digest``)."""
    ok: bool
    """Whether it succeeded."""


class ReplyEnding(BaseModel):
    """The end a layer gave a reply, to come after the current step's results."""

    finished_reason: str
    """A :data:`~fleetbus.protocol.FinishedReason`."""
    content: str
    handoff_to: str | None = None
    """With ``handed_off``: the agent that takes the conversation over."""
    handoff_reason: str = ""


class ReplyState(BaseModel):
    """The reply in progress (``None`` in :class:`AgentState` between replies)."""

    reply_id: str
    session_id: str | None = None
    request_id: str | None = None
    """The ``call_id`` of the message this reply answers now (the request, or
    the ``confirm_result`` / ``external_result`` that resumed it): the
    ``call_id`` of its ``final_answer``, so a requester matches the answer to
    its request wherever it reads it (a take-over included)."""
    iteration: int = 0
    """The reasoning step to run next."""
    pending: list[PendingCall] = Field(default_factory=list)
    """Non-empty while paused."""
    structured_name: str | None = None
    structured_schema: dict[str, Any] | None = None
    structured_failures: int = 0
    last_failure: str | None = None
    """The last failing call (tool name and canonical arguments)."""
    repeat_count: int = 0
    """How many times in a row that call failed."""
    recent_calls: list[RecentCall] = Field(default_factory=list)
    """The reply's last tool calls, oldest first: only as many as loop
    detection looks at (a call repeated after it succeeded, a short cycle),
    so the saved state stays bounded and a take-over goes on detecting."""
    loops_shown: list[str] = Field(default_factory=list)
    """The loops the model was already shown (a few keys): seen again, they
    end the reply."""
    input_tokens: int = 0
    output_tokens: int = 0
    tool_calls: int = 0
    answered: list[str] = Field(default_factory=list)
    """The ``call_id`` of every tool call of the current step already answered
    (cleared at each step, so the saved state does not grow with the reply)."""
    arrived: list[Msg] = Field(default_factory=list)
    """Results of the current step's tool calls that arrived and are not yet in
    memory (memory gets them in the model's order once the step's calls are
    done); saved as each arrives, so no call is run again after its result."""
    ending: ReplyEnding | None = None
    """How the reply ends once the current step's tool calls are all answered,
    when a layer said so (:meth:`ReplyContext.end_after_step
    <fleetbus.agents.middleware.ReplyContext.end_after_step>`): saved with the
    step's results, so a replica that takes the reply over ends it the same way."""


class AgentState(BaseModel):
    """All an agent needs to continue; JSON in, JSON out."""

    format_version: int = STATE_VERSION
    agent_name: str
    memory: list[Msg] = Field(default_factory=list)
    summary: Summary | None = None
    """The structured summary standing for compressed older messages."""
    plan: PlanNotebook | None = None
    permissions: Permissions = Field(default_factory=Permissions)
    active_groups: list[str] | None = None
    """The switchable tool groups the model switched on (``switch_tool_groups``);
    ``None`` until it first switches: the toolkit's defaults."""
    reply: ReplyState | None = None

    @property
    def paused(self) -> bool:
        """Whether a reply waits for confirmations or external results."""
        return self.reply is not None and bool(self.reply.pending)

    def memory_index(self) -> MemoryIndex:
        """The :class:`MemoryIndex` of this state's memory, brought up to date.

        Made at the first call and kept with the state (in ``__dict__``, as
        ``functools.cached_property`` keeps its value): pydantic neither
        serializes nor compares it, and a copy or a pickle of the state starts
        with an empty one.
        """
        index = self.__dict__.get("_memory_index")
        if index is None:
            index = self.__dict__["_memory_index"] = MemoryIndex()
        index.sync(self.memory)
        return index


class MemoryIndex:
    """What a reasoning step needs of the whole memory, kept in step with it.

    The chat form of every message but hints (what the model is sent), the
    tokens memory takes (compression compares them with its threshold), and
    the ids of its tool calls (a model's new call must not reuse one). Each
    message is worked on once: :meth:`sync` takes in the messages appended
    since it last looked, after checking that those it knows are still there
    (a list comparison, done in C and stopping at identical objects, so it
    stays cheap however long the memory). Memory changed otherwise — cut at
    the end, a message replaced, a compression putting a summary in place of
    the older messages — is taken in from the first message that differs
    (found by bisection), reusing the chat form of the messages seen before
    (:meth:`Msg.to_chat` makes it once).

    Messages are immutable (a ``Msg`` is frozen; its content list must not be
    changed in place): a message is recognised by identity or equality.
    """

    def __init__(self) -> None:
        self._messages: list[Msg] = []
        """Memory as last synced: the same objects."""
        self._chats: list[ChatMessage] = []
        self._call_ids: dict[str, int] = {}
        """Every tool call id of memory, with how many messages carry it."""
        self._counter: TokenCounter | None = None
        self._tokens: list[int] = []
        """The counts of the first messages (counted when asked for)."""
        self._total = 0

    def __reduce__(self) -> tuple[type[MemoryIndex], tuple[()]]:
        # Copies (copy, deepcopy, model_copy(deep=True)) and pickles start empty.
        return (MemoryIndex, ())

    def copy(self) -> MemoryIndex:
        """An index of its own for a copy of memory (the lists copied, the
        messages and chat forms shared: they are immutable)."""
        other = MemoryIndex()
        other._messages = list(self._messages)
        other._chats = list(self._chats)
        other._call_ids = dict(self._call_ids)
        other._counter = self._counter
        other._tokens = list(self._tokens)
        other._total = self._total
        return other

    @property
    def chats(self) -> list[ChatMessage]:
        """The chat forms of memory's messages but hints, oldest first (read only)."""
        return self._chats

    @property
    def call_ids(self) -> Container[str]:
        """The ids of every tool call in memory."""
        return self._call_ids

    def tokens(self, counter: TokenCounter) -> int:
        """The tokens memory takes: the sum of its messages' counts, each
        message counted once (by ``counter``; another counter counts anew).

        Raises whatever ``counter`` raises.
        """
        if counter is not self._counter:
            self._counter, self._tokens, self._total = counter, [], 0
        counts = self._tokens
        # A counter that counts one message (ApproxTokenCounter) is asked for
        # each by itself: no list made, no cache of its own filled.
        count_message = getattr(counter, "count_message", None)
        for message in self._messages[len(counts) :]:
            count = count_message(message) if count_message else counter.count([message])
            counts.append(count)
            self._total += count
        return self._total

    def sync(self, memory: list[Msg]) -> None:
        """Bring the index up to date with ``memory``."""
        known = self._messages
        had, has = len(known), len(memory)
        if has >= had:
            # Appended to (or unchanged): take the new messages, then check the
            # rest is the same (a comparison with no copy of the known part).
            known += memory[had:]
            if memory == known:
                self._work_on(had)
                return
            del known[had:]
        # Changed before its end: find where (a bisection of list comparisons),
        # forget what follows, work on what is there now.
        same, differs = 0, min(had, has) + 1
        while differs - same > 1:
            middle = (same + differs) // 2
            if memory[same:middle] == known[same:middle]:
                same = middle
            else:
                differs = middle
        if same:
            self._drop(same)
        else:  # all of it (a compression): nothing to take away one by one
            self._messages, self._chats, self._call_ids = [], [], {}
            self._tokens, self._total = [], 0
        self._messages += memory[same:]
        self._work_on(same)

    def _work_on(self, start: int) -> None:
        """Take in the known messages from ``start`` on (the index knows those before)."""
        chats, ids = self._chats, self._call_ids
        for message in self._messages[start:]:
            if "hint" not in message.marks:
                chats.append(message.to_chat())
            for block in message.content:  # its tool_uses, without the list
                if isinstance(block, ToolUseBlock):
                    ids[block.id] = ids.get(block.id, 0) + 1

    def _drop(self, keep: int) -> None:
        """Forget the messages after the first ``keep``."""
        dropped = self._messages[keep:]
        del self._messages[keep:]
        shown = sum(1 for message in dropped if "hint" not in message.marks)
        if shown:
            del self._chats[-shown:]
        ids = self._call_ids
        for message in dropped:
            for use in message.tool_uses:
                left = ids[use.id] - 1
                if left:
                    ids[use.id] = left
                else:
                    del ids[use.id]
        if len(self._tokens) > keep:
            self._total -= sum(self._tokens[keep:])
            del self._tokens[keep:]
