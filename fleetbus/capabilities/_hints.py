"""Hints shown to the model with one reply's calls and never stored: what a
long-term memory or a knowledge base found for the reply's input."""

from __future__ import annotations

from fleetbus.agents.messages import Msg
from fleetbus.protocol import ChatMessage

__all__ = ["with_hint"]


def with_hint(messages: list[ChatMessage], hint: str, anchor: object) -> list[ChatMessage]:
    """``messages`` with ``hint`` as a user message just before the reply's
    input (``anchor``: the input's chat form, or an equal copy of it), else
    last.

    Before the input, not after it: the input stays the latest thing the user
    said, which is what a model answers (the offline model, and small local
    ones, take the last user message as the request).
    """
    chat = Msg.text_message("user", hint, marks={"hint"}).to_chat()
    at = len(messages)
    for index in range(len(messages) - 1, -1, -1):
        if messages[index] is anchor:
            at = index
            break
    else:  # a copy of the input (a model request made anew): the latest equal message
        for index in range(len(messages) - 1, -1, -1):
            if messages[index] == anchor:
                at = index
                break
    return [*messages[:at], chat, *messages[at:]]
