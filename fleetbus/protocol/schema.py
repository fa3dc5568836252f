"""JSON Schema of every wire message, for clients written in other languages."""

from __future__ import annotations

import inspect
from typing import Any

import msgspec

from fleetbus.protocol.codec import MESSAGE_TYPES, AnyMessage
from fleetbus.protocol.messages import PROTOCOL_VERSION

__all__ = ["message_schemas", "render_schemas"]

_DRAFT = "https://json-schema.org/draft/2020-12/schema"


def message_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schema documents to publish, by file name.

    One file per message type (``tool_call.json``…) and ``messages.json``, the
    tagged union of them all. Each is self-contained (its own ``$defs``).
    """
    schemas: dict[str, dict[str, Any]] = {}
    for tag, cls in sorted(MESSAGE_TYPES.items()):
        schema = msgspec.json.schema(cls)
        schemas[f"{tag}.json"] = _document(schema, title=tag, cls=cls)
    union = msgspec.json.schema(AnyMessage)
    schemas["messages.json"] = _document(union, title="message", cls=None)
    return schemas


def render_schemas() -> dict[str, str]:
    """:func:`message_schemas` as the exact text written to disk."""
    import json

    return {
        name: json.dumps(schema, indent=2, sort_keys=True) + "\n"
        for name, schema in message_schemas().items()
    }


def _document(schema: dict[str, Any], *, title: str, cls: type | None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "$schema": _DRAFT,
        "$id": f"fleetbus/protocol/v{PROTOCOL_VERSION}/{title}",
    }
    doc.update(_cleaned(schema))
    if cls is not None:
        doc["description"] = (cls.__doc__ or "").strip().splitlines()[0]
    return doc


def _cleaned(node: Any) -> Any:
    """``node`` as the newest msgspec makes it, whichever made it: every
    description's docstring indentation removed (0.18 keeps it), and an
    ``anyOf``'s ``null`` last (0.18 and 0.20 put it first)."""
    if isinstance(node, dict):
        cleaned = {
            k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else _cleaned(v)
            for k, v in node.items()
        }
        if isinstance(cleaned.get("anyOf"), list):
            null = {"type": "null"}
            cleaned["anyOf"] = [v for v in cleaned["anyOf"] if v != null] + [
                v for v in cleaned["anyOf"] if v == null
            ]
        return cleaned
    if isinstance(node, list):
        return [_cleaned(v) for v in node]
    return node
