"""A deterministic model that needs no network: a tiny rule-based ReAct planner.

:class:`OfflineModel` is not an LLM, and says so: the first answer of every
conversation starts with :data:`OFFLINE_PREFIX`. It reads the latest user
message for simple requests — arithmetic, the time, writing, reading and
listing files — and calls the matching tools on offer, one per step, then sums
up their results. It fills a structured answer (``generate_response``) from its
JSON Schema, and in a multi-agent chat it argues the stance its ``persona`` or
system prompt gives it, answering the last speaker; offered a handoff
(``transfer_to_<agent>``) whose agent or description the request names, it
hands the conversation over::

    agent = Agent("helper", "You help.", OfflineModel(), toolkit=builtin_toolkit())
    answer = await agent.reply("What is 2026 - 1991?")  # calls calculator, says 35

A step reads the conversation from its latest request on; what it needs of
all of it (its size for the usage, the calls made, the answers given, the
system prompt) is tallied message by message and kept for the next request of
the same conversation, which is the same messages and a few more: a step costs
the same at the tenth message as at the thousandth, where reading everything
anew made a step's cost grow with the conversation.
"""

from __future__ import annotations

import functools
import json
import re
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from fleetbus.models.model import (
    FINISH_TOOL,
    ModelError,
    ModelRequest,
    ModelResponse,
    ModelStreamItem,
    TextDelta,
    ThinkingDelta,
)
from fleetbus.protocol import (
    ChatMessage,
    ContentBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
    Usage,
)

__all__ = ["OFFLINE_PREFIX", "OfflineModel"]

OFFLINE_PREFIX = "(offline model) "
"""How the first answer of a conversation starts, so nobody takes it for an LLM."""

_B = TypeVar("_B")
_Intent = tuple[int, str, dict[str, Any]]
"""Where a request starts in the text, the tool, its arguments."""
_CHOICES = (None, "auto", "none", "required")
# Injected instructions, summaries and plan hints: never a user's request.
_HINT_STARTS = ("<plan_hint>", "<summary of earlier", "<earlier conversation", "You have used all",
                "The reply must end now", "Give your final answer by calling the tool")  # fmt: skip
_MAX_PARSED = 10_000  # characters of a message searched for requests: bounds the work
_TALLIES_KEPT = 1024  # conversations whose tally is kept (many agents may share a model)
_TALLIED_MESSAGES = 10_000
"""Messages the kept tallies hold together, at most (each holds its whole
conversation): a host that reloads its sessions from the store, as new
objects, started a tally per request, and a long-lived replica grew by a copy
of each conversation (67 to 703 MB in a 10-minute soak)."""
_JSON = msgspec.json.Encoder(enc_hook=str)
_NUM = r"\d+(?:\.\d+)?"
_ARITH = re.compile(
    rf"(?<![(\d.])(?:\(\s*)*+-?{_NUM}(?:[\s)]*(?:\*\*|//|[-+*/%^\u00d7\u00f7])[\s(]*-?\s*{_NUM})+[\s)]*"
)
_DATE = re.compile(r"\d{4}-\d\d-\d\d")
_PATH = r"[`'\"]?(?P<path>[\w~.-]*(?:/[\w~.-]+)+/?|[\w~-][\w~.-]*\.\w+)"
_QUOTED = r"(?:\"(?P<dq>[^\"]*)\"|'(?P<sq>[^']*)'|“(?P<cq>[^”]*)”)"
_FILE = r"\s+(?:the\s+)?(?:file\s+)?"
_WRITES = (
    re.compile(rf"\b(?:write|save|put|store)\s+(?:{_QUOTED}|(?P<raw>.+?))\s+(?:to|into|in|as)"
               rf"{_FILE}{_PATH}", re.I | re.S),
    re.compile(rf"\bnote:\s*(?:{_QUOTED}|(?P<raw>.+?))\s+in{_FILE}{_PATH}", re.I | re.S),
)  # fmt: skip
_WRITE_WORDS = (("write", "save", "put", "store"), ("note:",))
"""The words each of ``_WRITES`` needs (lower case)."""
_READ = re.compile(rf"\b(?:read|open|cat)\b{_FILE}{_PATH}", re.I)
_LIST = re.compile(r"\b(?:list|ls|(?:what|which)\s+files)\b(?P<rest>[^.?!;,\n]*)", re.I)
_READ_WORDS = ("read", "open", "cat")
_LIST_WORDS = ("list", "ls", "what", "which")
_NOT_A_VERB = re.compile(r"\b(?:a|an|the|my|your|this|that|shopping|to-do|todo)\s*$", re.I)
_LIST_STOP = frozenset({
    "the", "all", "files", "file", "in", "of", "my", "me", "please", "directory", "folder", "dir",
    "contents", "content", "there", "are", "is", "inside", "under", "workspace", "root", "current",
    "available", "exist", "do", "you", "have", "here", "a",
})  # fmt: skip
_TIME = re.compile(r"\b(?:time|clock|date)\b", re.I)
_TIME_WORDS = ("time", "clock", "date")
_CUE = re.compile(r"\b(?:what|when|which|tell|current|show|give|get|check|today)\b", re.I)
_CLAUSE_END = re.compile(r"[!?;,\n]|\.(?:\s|$)|\band\b|\bthen\b", re.I)
_ZONE = re.compile(r"\b(?:[A-Z][A-Za-z_]+/[A-Z][A-Za-z_]+(?:/[A-Z][A-Za-z_]+)?|UTC|GMT)\b")
_CITIES = {
    "tokyo": "Asia/Tokyo", "london": "Europe/London", "paris": "Europe/Paris",
    "berlin": "Europe/Berlin", "lisbon": "Europe/Lisbon", "madrid": "Europe/Madrid",
    "rome": "Europe/Rome", "amsterdam": "Europe/Amsterdam", "moscow": "Europe/Moscow",
    "new york": "America/New_York", "chicago": "America/Chicago", "toronto": "America/Toronto",
    "los angeles": "America/Los_Angeles", "san francisco": "America/Los_Angeles",
    "mexico city": "America/Mexico_City", "sao paulo": "America/Sao_Paulo",
    "sydney": "Australia/Sydney", "singapore": "Asia/Singapore", "hong kong": "Asia/Hong_Kong",
    "beijing": "Asia/Shanghai", "shanghai": "Asia/Shanghai", "seoul": "Asia/Seoul",
    "mumbai": "Asia/Kolkata", "delhi": "Asia/Kolkata", "dubai": "Asia/Dubai",
    "cairo": "Africa/Cairo", "johannesburg": "Africa/Johannesburg",
}  # fmt: skip
_STANCES = (
    re.compile(r"\b(?:your|my)\s+(?:position|stance|view|opinion|thesis|side)\s*(?:is|:)\s*"
               r"(?:that\s+)?(?P<p>.+)", re.I),
    re.compile(r"\b(?:position|stance|thesis)\s*:\s*(?P<p>.+)", re.I),
    re.compile(r"\byou\s+(?:firmly\s+|strongly\s+)?(?:argue|believe|think|hold|maintain|insist|"
               r"claim|contend|feel)s?\s+(?:that\s+)?(?P<p>.+)", re.I),
)  # fmt: skip
# A role worth speaking in ("You are Alice, a skeptic"), not a generic assistant.
_ROLE = re.compile(r"\byou are (?![^.;\n]*\b(?:assistant|helper|agent|ai|bot|model)\b)"
                   r"(?P<r>[^.;\n]+)", re.I)  # fmt: skip
_PRONOUNS = {"your": "my", "yours": "mine", "yourself": "myself", "you": "I", "you're": "I'm"}
_LOWER_FIRST = frozenset({"the", "a", "an", "we", "it", "this", "that", "there", "all", "every",
                          "our", "they", "people", "most"})  # fmt: skip
_POSITION = ("I maintain that {p}.", "My position stands: {p}.", "Let me be clear: {p}.",
             "I keep coming back to this: {p}.")  # fmt: skip
_REPLY_NAMED = ('{who} says "{q}", but I see it differently.',
                "I hear {who}'s point that \"{q}\"; it does not change my mind.",
                'Responding to {who}: "{q}" leaves out what matters most.',
                '{who} argued "{q}". Fair, yet the argument cuts the other way.')  # fmt: skip
_REPLY_USER = ('You asked: "{q}".', 'On "{q}", here is where I stand.',
               'You raise "{q}".', 'About "{q}": my answer is the same.')  # fmt: skip
_CAN = {"calculator": 'calculate ("what is 6*7")',
        "current_time": 'tell the time ("time in Tokyo")'}  # fmt: skip
_FORMATS = {"date-time": "2000-01-01T00:00:00Z", "date": "2000-01-01", "time": "00:00:00",
            "email": "offline@example.com", "uri": "https://example.com"}  # fmt: skip
_CLOSERS = ("What would convince you otherwise?", "That is where the evidence points.",
            "I would like to hear a counterexample.",
            "Let us weigh the costs honestly.")  # fmt: skip


class OfflineModel:
    """A deterministic, rule-based model: no network, no API key, no LLM.

    Args:
        name: the model's name.
        persona: a voice or stance for chat answers (otherwise taken from the
            system prompt: "You argue that…", "Your position: …").
        chunk_size: stream text in pieces of this many characters.
    """

    def __init__(
        self, name: str = "fleetbus-offline", *, persona: str | None = None, chunk_size: int = 12
    ) -> None:
        self._name = name
        self._persona = persona
        self._chunk_size = max(1, chunk_size)
        self._tallies: OrderedDict[int, _Tally] = OrderedDict()
        """By the id of the conversation's first message (held by its tally)."""
        self._tallied = 0
        """The messages the kept tallies hold."""

    @property
    def name(self) -> str:
        """The model's name."""
        return self._name

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        """Decide the next step of the conversation, streaming its text.

        Raises:
            ModelError: the request cannot be answered (not a request, messages
                that are not chat messages, a ``tool_choice`` naming no tool on offer);
                never retryable.
        """
        _validate(request)
        tally = self._tally(request.messages)
        content, finish_reason = self._decide(request, tally)
        for block in content:
            if isinstance(block, ThinkingBlock):
                yield ThinkingDelta(block.thinking)
            elif isinstance(block, TextBlock):
                for i in range(0, len(block.text), self._chunk_size):
                    yield TextDelta(block.text[i : i + self._chunk_size])
        out = sum(len(b.text) if isinstance(b, TextBlock) else _size(b) for b in content)
        size = tally.size + sum(_size(t.parameters) for t in request.tools)
        yield ModelResponse(
            content=content,
            usage=Usage(input_tokens=max(1, size // 4), output_tokens=max(1, out // 4)),
            finish_reason=finish_reason,
            model=self._name,
        )

    def _tally(self, messages: Sequence[ChatMessage]) -> _Tally:
        """The tally of ``messages``: the one kept for their conversation, brought up to date.

        Raises:
            ModelError: a message is not a ``ChatMessage`` (not retryable).
        """
        listed = messages if isinstance(messages, list) else list(messages)
        first = next(
            (m for m in listed if not isinstance(m, ChatMessage) or m.role != "system"), None
        )
        if first is None:  # nothing but a system prompt: nothing to keep
            return _Tally().follow(listed)
        tallies = self._tallies
        tally = tallies.pop(id(first), None)  # not put back if the messages are refused
        if tally is not None:
            self._tallied -= len(tally.messages)
        if tally is None or tally.first is not first:
            tally = _Tally(first=first)
        tally.follow(listed)
        tallies[id(first)] = tally
        self._tallied += len(tally.messages)
        while len(tallies) > _TALLIES_KEPT or (
            len(tallies) > 1 and self._tallied > _TALLIED_MESSAGES
        ):
            _, dropped = tallies.popitem(last=False)
            self._tallied -= len(dropped.messages)
        return tally

    def _decide(self, request: ModelRequest, tally: _Tally) -> tuple[list[ContentBlock], str]:
        tools = {t.name: t for t in request.tools}
        choice = request.tool_choice
        start = _last_request(request.messages)
        user_text = _text(request.messages[start]) if start >= 0 else ""
        turn = [m for m in request.messages[start + 1 :] if not _is_hint(m)]
        uses = [b for m in turn if m.role == "assistant" for b in _blocks(m, ToolUseBlock)]
        results = [b for m in turn if m.role == "tool" for b in _blocks(m, ToolResultBlock)]
        args_of = {u.id: u.input for u in uses}
        lines = [_describe(r, args_of.get(r.id, {})) for r in results if r.name != FINISH_TOOL]
        if choice != "none" and tools:
            intents = [(tool, args) for _, tool, args in _parse(user_text) if tool in tools]
            done = sum(1 for u in uses if u.name != FINISH_TOOL)

            def filled(schema: dict[str, Any]) -> dict[str, Any]:
                # (made only for a call the request does not spell out)
                summary = "; ".join(lines) or _clip(user_text, 300) or "nothing to summarize"
                return _fill(schema, summary, _numbers(results, user_text))

            if choice not in _CHOICES:
                spec = tools[str(choice)]
                forced = [args for tool, args in intents[done:] if tool == spec.name]
                args = forced[0] if forced else filled(spec.parameters)
                return _call(tally, spec.name, args), "tool_calls"
            if done < len(intents):
                return _call(tally, *intents[done]), "tool_calls"
            handoff = None if intents or uses else _handoff(request.tools, user_text)
            if handoff is not None:
                return _call(tally, *handoff), "tool_calls"
            if FINISH_TOOL in tools:
                args = filled(tools[FINISH_TOOL].parameters)
                return _call(tally, FINISH_TOOL, args), "tool_calls"
        if len(lines) == 1:
            text = lines[0] + "."
        elif lines:
            text = "Here is what I found:\n- " + "\n- ".join(lines)
        else:
            speaker = request.messages[start] if start >= 0 else None
            text = self._chat(speaker, tally, [*tools])
        answered = tally.answers > 0
        return [TextBlock(text=text if answered else OFFLINE_PREFIX + text)], "stop"

    def _chat(self, speaker: ChatMessage | None, tally: _Tally, tools: list[str]) -> str:
        """A text answer without tools: a stance in a debate, else a plain reply."""
        turn = tally.answers
        quote = _quote(_text(speaker)) if speaker is not None else ""
        system = " ".join(text for _, text in tally.systems)
        position = _stance(self._persona or "") or _stance(system)
        role = _ROLE.search(system)
        voice = self._persona or (_swap(role.group("r")) if role else None)
        if position or voice:
            salt = zlib.crc32((position or voice or "").encode())
            parts = [
                _POSITION[(turn + salt) % 4].format(p=position)
                if position
                else f"Speaking as {voice}, I will weigh in."
            ]
            if quote and speaker is not None and speaker.name:
                parts.append(_REPLY_NAMED[(turn + salt // 4) % 4].format(who=speaker.name, q=quote))
            elif quote:
                parts.append(_REPLY_USER[(turn + salt // 4) % 4].format(q=quote))
            parts.append(_CLOSERS[(turn + salt // 16) % 4])
            return " ".join(parts)
        can = _capabilities(tools)
        if not quote:
            return f"Hello. I am a rule-based offline model (no LLM, no network). {can}"
        return (
            f"I am a rule-based offline model, not an LLM, so I only follow simple requests. "
            f'You said: "{quote}". {can}',
            f'Noted: "{quote}". {can}',
            f'I read "{quote}", but found no request I can act on. {can}',
        )[turn % 3]


@dataclass(slots=True)
class _Tally:
    """What the model needs of a whole conversation, position by position.

    The next request of a conversation is the same messages (compared equal,
    in C, stopping at identical objects) and a few more, or the last few
    changed (a hint, a compression): only the messages from the first that
    differs are read.
    """

    first: ChatMessage | None = None
    """The conversation's first message but the system prompt: keys the tally."""
    messages: list[ChatMessage] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    """``sizes[i]``: the size (bytes of the contents' JSON) of ``messages[: i + 1]``."""
    said: list[int] = field(default_factory=list)
    """``said[i]``: how many assistant messages with text ``messages[: i + 1]`` holds."""
    systems: list[tuple[int, str]] = field(default_factory=list)
    """The position and text of each system message."""
    calls: list[tuple[int, str]] = field(default_factory=list)
    """The position of the message and the id of each tool call."""
    used: dict[str, int] = field(default_factory=dict)
    """Each tool call id, with how many calls carry it."""

    @property
    def size(self) -> int:
        """The size of the conversation."""
        return self.sizes[-1] if self.sizes else 0

    @property
    def answers(self) -> int:
        """How many times the assistant answered with text."""
        return self.said[-1] if self.said else 0

    def follow(self, messages: list[ChatMessage]) -> _Tally:
        """Bring the tally up to ``messages``; itself.

        Raises:
            ModelError: a message is not a ``ChatMessage`` (not retryable).
        """
        known = self.messages
        had = len(known)
        if len(messages) >= had:
            known += messages[had:]  # taken for the same, then checked
            if messages == known:
                self._take(had)
                return self
            del known[had:]
        same = _common(known, messages)
        self._cut(same)
        known += messages[same:]
        self._take(same)
        return self

    def _take(self, start: int) -> None:
        """Tally the messages from ``start`` on."""
        for at in range(start, len(self.messages)):
            message = self.messages[at]
            if not isinstance(message, ChatMessage):
                raise ModelError(
                    "the offline model cannot answer: request.messages must be ChatMessages",
                    retryable=False,
                )
            text = _text(message)
            self.sizes.append(self.size + _size(message.content))
            self.said.append(self.answers + (message.role == "assistant" and bool(text.strip())))
            if message.role == "system":
                self.systems.append((at, text))
            for use in _blocks(message, ToolUseBlock):
                self.calls.append((at, use.id))
                self.used[use.id] = self.used.get(use.id, 0) + 1

    def _cut(self, keep: int) -> None:
        """Forget the messages after the first ``keep``."""
        del self.messages[keep:], self.sizes[keep:], self.said[keep:]
        while self.systems and self.systems[-1][0] >= keep:
            self.systems.pop()
        while self.calls and self.calls[-1][0] >= keep:
            call_id = self.calls.pop()[1]
            left = self.used[call_id] - 1
            if left:
                self.used[call_id] = left
            else:
                del self.used[call_id]


def _common(known: list[ChatMessage], messages: list[ChatMessage]) -> int:
    """How many first messages ``messages`` has in common with ``known`` (bisection)."""
    same, differs = 0, min(len(known), len(messages)) + 1
    while differs - same > 1:
        middle = (same + differs) // 2
        if messages[same:middle] == known[same:middle]:
            same = middle
        else:
            differs = middle
    return same


_HANDOFF_TOOL = "transfer_to_"
_HANDOFF_WORDS = frozenset({"conversation", "answers", "agent", "which", "there"})


def _handoff(tools: Sequence[ToolSpec], text: str) -> tuple[str, dict[str, Any]] | None:
    """A handoff tool (``transfer_to_<agent>``) whose agent, or a word of five
    letters or more of whose description, the request names: the first."""
    words = set(re.findall(r"[a-z]{4,}", text.lower()))
    for spec in tools:
        if not spec.name.startswith(_HANDOFF_TOOL):
            continue
        agent = spec.name[len(_HANDOFF_TOOL) :].lower()
        keys = set(re.findall(r"[a-z]{5,}", spec.description.lower())) - _HANDOFF_WORDS
        found = sorted(({agent} | keys) & words)
        if found:
            return spec.name, {"reason": f"the request is about {found[0]}"}
    return None


def _call(tally: _Tally, tool: str, args: dict[str, Any]) -> list[ContentBlock]:
    """A call of ``tool`` with an id no call of the conversation has."""
    used = tally.used
    n = len(used) + 1
    while f"offline_{n}" in used:
        n += 1
    shown = ", ".join(f"{k}={_clip(json.dumps(v, default=str), 60)}" for k, v in args.items())
    use = ToolUseBlock(id=f"offline_{n}", name=tool, input=args)
    return [ThinkingBlock(thinking=f"Next step: call {tool}({shown})."), use]


def _last_request(messages: Sequence[ChatMessage]) -> int:
    """The position of the last user message that is not a hint, or -1."""
    for at in range(len(messages) - 1, -1, -1):
        message = messages[at]
        if message.role == "user" and not _is_hint(message):
            return at
    return -1


def _validate(request: object) -> None:
    """Check the request (its messages are checked as they are tallied)."""
    problem = ""
    if not isinstance(request, ModelRequest):
        problem = f"not a ModelRequest but a {type(request).__name__}"
    elif not all(isinstance(t, ToolSpec) for t in request.tools):
        problem = "request.tools must be ToolSpecs"
    elif request.tool_choice not in (*_CHOICES, *(t.name for t in request.tools)):
        problem = f"tool_choice {request.tool_choice!r} names no tool on offer"
    if problem:
        raise ModelError(f"the offline model cannot answer: {problem}", retryable=False)


def _size(value: Any) -> int:
    """The size of ``value`` as JSON (what JSON cannot hold, as text): what
    usage counts of a message's content or a tool's schema. Written by
    msgspec, in a fifth of the time of ``repr`` and a tenth of
    ``json.dumps``'s: every step of every reply measures them."""
    try:
        return len(_JSON.encode(value))
    except (TypeError, ValueError):  # keys JSON cannot have, numbers too large
        return len(repr(value))


def _blocks(message: ChatMessage, kind: type[_B]) -> list[_B]:
    content = message.content if isinstance(message.content, list) else []
    return [b for b in content if isinstance(b, kind)]


def _text(message: ChatMessage) -> str:
    return "\n".join(b.text for b in _blocks(message, TextBlock))


def _is_hint(message: ChatMessage) -> bool:
    hint = message.name == "hint" or _text(message).lstrip().startswith(_HINT_STARTS)
    return message.role == "user" and hint


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + "…"


def _quote(text: str) -> str:
    """The first sentence of what someone said, without quotes inside, to quote it."""
    text = text.removeprefix(OFFLINE_PREFIX.strip()).strip()
    for template in _POSITION:  # quote the other's position, not our phrasing of it
        text = text.removeprefix(template.split("{p}")[0])
    text = re.sub(r"\"[^\"]*\"|“[^”]*”", "…", text)
    first = re.split(r"(?<=[.!?])\s", text.strip(), maxsplit=1)[0]
    return _clip(first, 80).rstrip(".!?")


def _stance(text: str) -> str | None:
    """A position stated in second person ("You argue that X"), in first person."""
    for sentence in re.split(r"(?<=[.!?])\s+|\n", text):
        sentence = sentence.strip().rstrip(".!")
        found = next((m for p in _STANCES if (m := p.search(sentence))), None)
        if found is None:
            continue
        words = _swap(found.group("p")).split()
        if words and words[0].lower() in _LOWER_FIRST:
            words[0] = words[0].lower()
        return " ".join(words) or None
    return None


def _swap(text: str) -> str:
    """Second person to first: "your view" -> "my view"."""
    return " ".join(_PRONOUNS.get(w.lower(), w) for w in text.strip().split())


def _capabilities(tools: list[str]) -> str:
    can = [text for tool, text in _CAN.items() if tool in tools]
    files = [t.split("_")[0] for t in ("read_file", "write_file", "list_dir") if t in tools]
    can += [f"{', '.join(files)} files"] if files else []
    return f"Ask me to {'; '.join(can)}." if can else "I have no tools here to act with."


def _parse(text: str) -> list[_Intent]:
    """The tool requests in ``text``, in order of appearance (each call's
    arguments a dict of its own)."""
    return [(at, tool, dict(args)) for at, tool, args in _parsed(text)]


@functools.lru_cache(maxsize=256)
def _parsed(text: str) -> tuple[_Intent, ...]:
    """:func:`_parse`, kept for the texts seen last: every step of a reply
    reads the same request again, and parsing it is a sizeable part of a
    served step."""
    return tuple(_scan(text))


def _absent(lowered: str | None, words: tuple[str, ...]) -> bool:
    """Whether none of ``words`` is in ``lowered`` (the lowered text, ``None``
    when it is not ASCII: then nothing is known absent)."""
    return lowered is not None and not any(word in lowered for word in words)


def _scan(text: str) -> list[_Intent]:
    intents: list[_Intent] = []
    masked = text[:_MAX_PARSED]

    def take(m: re.Match[str], tool: str, args: dict[str, Any]) -> None:
        nonlocal masked
        intents.append((m.start(), tool, args))
        masked = masked[: m.start()] + " " * (m.end() - m.start()) + masked[m.end() :]

    # Each pattern below needs one of a few words; on ASCII text a word's
    # absence is one substring test, far cheaper than a case-insensitive
    # search of the prompt (on non-ASCII text re.I folds more
    # than lower() does: every pattern runs). Masking only blanks what
    # matched, so a word absent from the text is absent from the masked text.
    lowered = masked.lower() if masked.isascii() else None
    for pattern, needed in zip(_WRITES, _WRITE_WORDS, strict=True):
        if _absent(lowered, needed):
            continue
        for m in list(pattern.finditer(masked)):
            body = next((g for g in (m["dq"], m["sq"], m["cq"]) if g is not None), m["raw"])
            take(m, "write_file", {"path": m["path"].rstrip("."), "content": body.strip()})
    for m in [] if _absent(lowered, _READ_WORDS) else list(_READ.finditer(masked)):
        take(m, "read_file", {"path": m["path"].rstrip(".")})
    for m in [] if _absent(lowered, _LIST_WORDS) else list(_LIST.finditer(masked)):
        if _NOT_A_VERB.search(masked[max(0, m.start() - 12) : m.start()]):
            continue
        rest = re.split(r"\band\b|\bthen\b", m["rest"], maxsplit=1, flags=re.I)[0]
        words = [w for w in re.findall(r"[\w~./-]+", rest) if w.lower() not in _LIST_STOP]
        take(m, "list_dir", {"path": words[0].rstrip(".") if words else "."})
    for m in _ARITH.finditer(masked):
        expr = _balance(m.group().strip())
        if expr and not _DATE.fullmatch(expr):
            for old, new in (("^", "**"), ("\u00d7", "*"), ("\u00f7", "/")):
                expr = expr.replace(old, new)
            intents.append((m.start(), "calculator", {"expr": expr}))
    if _absent(lowered, _TIME_WORDS):
        return sorted(intents, key=lambda i: i[0])
    begin = 0
    for stop in [*_CLAUSE_END.finditer(masked), None]:  # one current_time per clause
        clause, at = masked[begin : stop.start() if stop else len(masked)], begin
        begin = stop.end() if stop else len(masked)
        word = _TIME.search(clause)
        question = stop is not None and stop.group() == "?"
        if word is None or not (question or _CUE.search(clause) or len(clause.split()) <= 4):
            continue
        zone = _ZONE.search(clause)
        city = next((z for c, z in _CITIES.items() if re.search(rf"\b{c}\b", clause, re.I)), None)
        timezone = zone.group() if zone else city or "UTC"
        intents.append((at + word.start(), "current_time", {"timezone": timezone}))
    return sorted(intents, key=lambda i: i[0])


def _balance(expr: str) -> str:
    """``expr`` without its unmatched parentheses."""
    unmatched: list[int] = []
    for i, ch in enumerate(expr):
        if ch == ")" and unmatched and expr[unmatched[-1]] == "(":
            unmatched.pop()
        elif ch in "()":
            unmatched.append(i)
    return "".join(ch for i, ch in enumerate(expr) if i not in unmatched).strip()


def _describe(result: ToolResultBlock, args: dict[str, Any]) -> str:
    """One line saying plainly what a tool call gave."""
    name, out = result.name, result.output
    if result.state != "success":
        verb = {"denied": "was denied", "timeout": "timed out", "cancelled": "was cancelled"}
        why = str(out).removeprefix(f"{result.state}: ")
        return f"{name} {verb.get(result.state, 'failed')}: {_clip(why, 200)}"
    if name == "calculator":
        return f"calculator: {args.get('expr', '?')} = {out}"
    if name == "current_time" and isinstance(out, dict):
        zone = out.get("timezone", args.get("timezone", "UTC"))
        return f"current_time in {zone}: {out.get('weekday', '')} {out.get('iso', '')}".rstrip()
    if name == "write_file":
        path = out.get("path", args.get("path")) if isinstance(out, dict) else args.get("path")
        size = f" ({out['bytes']} bytes)" if isinstance(out, dict) and "bytes" in out else ""
        return f"write_file: wrote {path}{size}"
    if name == "read_file":
        return f'read_file {args.get("path", "")}: "{_clip(str(out), 200)}"'
    if name == "list_dir" and isinstance(out, list):
        entries = [e for e in out if isinstance(e, dict)]
        names = [f"{e.get('name')}{'/' * (e.get('type') == 'dir')}" for e in entries]
        return f"list_dir {args.get('path', '.')}: {', '.join(names) or '(empty)'}"
    shown = out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)
    return f"{name}: {_clip(shown, 200)}"


def _numbers(results: list[ToolResultBlock], text: str) -> list[float | int]:
    """Numbers to fill a structure with: tool results first, then the user's."""
    found: list[float | int] = [
        r.output for r in results if r.state == "success" and type(r.output) in (int, float)
    ]
    for token in re.findall(rf"-?{_NUM}", text):
        found.append(float(token) if "." in token else int(token))
    return found


def _fill(schema: dict[str, Any], summary: str, numbers: list[float | int]) -> dict[str, Any]:
    """Arguments that fit ``schema``: strings get ``summary``, numbers ``numbers``."""
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    counter = iter(range(1 << 30))

    def value(node: Any, depth: int) -> Any:
        if not isinstance(node, dict) or depth > 12:
            return None
        ref = node.get("$ref")
        if isinstance(ref, str):
            return value(defs.get(ref.rsplit("/", 1)[-1], {}), depth + 1)
        if "const" in node:
            return node["const"]
        if node.get("enum"):
            return node["enum"][0]
        for key in ("anyOf", "oneOf", "allOf"):
            options = [o for o in node.get(key) or [] if isinstance(o, dict)]
            if options:
                return value(
                    next((o for o in options if o.get("type") != "null"), options[0]), depth + 1
                )
        kind = node.get("type", "object" if "properties" in node else "string")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        if kind == "object":
            props = node.get("properties", {})
            return {k: value(props.get(k, {}), depth + 1) for k in node.get("required", [])}
        if kind == "array":
            return [value(node.get("items", {}), depth + 1) for _ in range(node.get("minItems", 0))]
        if kind in ("integer", "number"):
            n = next(counter)
            number: float = numbers[n % len(numbers)] if numbers else 0
            low = node.get("minimum", node.get("exclusiveMinimum"))
            if isinstance(low, int | float):
                number = max(number, low + ("exclusiveMinimum" in node))
            high = node.get("maximum", node.get("exclusiveMaximum"))
            if isinstance(high, int | float):
                number = min(number, high - ("exclusiveMaximum" in node))
            return round(number) if kind == "integer" else number
        if kind == "boolean":
            return False
        if kind == "null":
            return None
        text = _FORMATS.get(node.get("format", ""), summary)
        text = text[: node.get("maxLength", len(text))]
        return text.ljust(node.get("minLength", 0), ".")

    try:
        filled = value(schema, 0)
    except (TypeError, ValueError, AttributeError):  # a schema too odd to follow
        return {}
    return filled if isinstance(filled, dict) else {}
