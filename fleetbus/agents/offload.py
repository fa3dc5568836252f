"""Offloading: keeping whole tool results out of a model's context.

A tool result longer than the context allows is :func:`cut`: the model sees
its beginning and a note; the full text goes to an :class:`Offloader` (a
directory, or a JetStream object store) under a reference the model can read
further with the tool ``read_offloaded`` (:data:`READ_OFFLOADED_SPEC`,
answered by :func:`read_offloaded`).

An agent served on the bus by ``fleetbus agent`` offloads to the fleet's
object store by default (:meth:`ObjectStoreOffloader.open`), so it can read
a long result of any tool, local or remote, as an agent given an offloader
in-process does.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from fleetbus.bus import Bus, ObjectStore, object_store
from fleetbus.errors import ConfigError, KeyNotFoundError
from fleetbus.protocol import ToolSpec

__all__ = [
    "OFFLOAD_STORE",
    "OFFLOAD_TTL",
    "READ_OFFLOADED_SPEC",
    "DirectoryOffloader",
    "ObjectStoreOffloader",
    "Offloader",
    "ReadOffloadedArgs",
    "cut",
    "read_offloaded",
    "was_cut",
]

logger = logging.getLogger(__name__)

DEFAULT_READ_LIMIT = 20_000
MAX_READ_LIMIT = 100_000

OFFLOAD_STORE = "offload"
"""The object store served agents offload to (the bucket is
``<prefix with _ for .>_offload``)."""

OFFLOAD_TTL = 7 * 24 * 3600.0
"""Seconds an offloaded result is kept in :data:`OFFLOAD_STORE` when
:meth:`ObjectStoreOffloader.open` creates it: a reference older than that
reads as gone, and the model is told so."""


@runtime_checkable
class Offloader(Protocol):
    """Somewhere to keep long texts, read back in slices by reference."""

    async def store(self, key: str, data: str) -> str:
        """Keep ``data`` under ``key`` (replacing any previous one); return its reference.

        Raises:
            StoreError: the write failed (or ``OSError`` for files).
        """
        ...

    async def load(self, ref: str, offset: int = 0, limit: int = DEFAULT_READ_LIMIT) -> str:
        """Characters ``offset`` to ``offset + limit`` of the text at ``ref``.

        Raises:
            KeyNotFoundError: ``ref`` names nothing this offloader holds.
            ConfigError: a negative ``offset`` or a ``limit`` below 1.
        """
        ...


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _object_name(key: str) -> str:
    """A file- and object-safe name for ``key``; distinct keys get distinct names."""
    safe = _UNSAFE.sub("_", key).lstrip(".")[:100]
    if safe and safe == key:
        return safe
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return f"{safe or 'result'}-{digest}"


def _slice(text: str, offset: int, limit: int) -> str:
    if offset < 0 or limit < 1:
        raise ConfigError(
            f"cannot read offset={offset}, limit={limit}: need offset >= 0, limit >= 1"
        )
    return text[offset : offset + limit]


class DirectoryOffloader:
    """Offloads to files in a directory (created on first store).

    References look like ``file:<name>``; a reference naming anything but a
    file directly in the directory is refused.

    Args:
        root: the directory.
    """

    scheme = "file:"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _write(self, name: str, data: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                file.write(data)
            os.replace(tmp, self.root / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _path(self, ref: str) -> Path:
        if not ref.startswith(self.scheme):
            raise KeyNotFoundError(f"{ref!r} is not a file: reference")
        name = ref[len(self.scheme) :]
        root = self.root.resolve()
        path = (root / name).resolve()
        if not name or path.parent != root:
            raise KeyNotFoundError(f"{ref!r} refers outside the offload directory")
        return path

    def _read(self, path: Path, ref: str) -> str:
        try:
            return path.read_text(encoding="utf-8")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise KeyNotFoundError(f"nothing is stored as {ref!r}") from None

    async def store(self, key: str, data: str) -> str:
        """Write ``data`` to a file named after ``key``; return ``file:<name>``.

        Raises:
            OSError: the file cannot be written.
        """
        name = _object_name(key)
        await asyncio.to_thread(self._write, name, data)
        return f"{self.scheme}{name}"

    async def load(self, ref: str, offset: int = 0, limit: int = DEFAULT_READ_LIMIT) -> str:
        """Characters ``offset`` to ``offset + limit`` of the file at ``ref``.

        Raises:
            KeyNotFoundError: no such file, or ``ref`` points outside the directory.
            ConfigError: a negative ``offset`` or a ``limit`` below 1.
        """
        path = self._path(ref)
        text = await asyncio.to_thread(self._read, path, ref)
        return _slice(text, offset, limit)


class ObjectStoreOffloader:
    """Offloads to a JetStream object store; references are ``nats-object://bucket/name``.

    Args:
        store: the object store, e.g. ``await fleetbus.bus.object_store(bus, "offload")``.
    """

    def __init__(self, store: ObjectStore) -> None:
        self._store = store

    @classmethod
    async def open(
        cls, bus: Bus, *, name: str = OFFLOAD_STORE, ttl: float | None = OFFLOAD_TTL
    ) -> ObjectStoreOffloader:
        """An offloader to the fleet's object store ``name``, created if
        missing with objects kept ``ttl`` seconds (for ever: ``None``).

        Raises:
            StoreError: JetStream is off, or the store cannot be opened or made.
        """
        return cls(await object_store(bus, name, ttl=ttl))

    async def store(self, key: str, data: str) -> str:
        """Put ``data`` as an object named after ``key``; return its URL.

        Raises:
            StoreError: the write failed.
        """
        name = _object_name(key)
        await self._store.put(name, data.encode("utf-8"))
        return self._store.url(name)

    async def load(self, ref: str, offset: int = 0, limit: int = DEFAULT_READ_LIMIT) -> str:
        """Characters ``offset`` to ``offset + limit`` of the object at ``ref``.

        Raises:
            KeyNotFoundError: no such object, or ``ref`` is not in this bucket.
            ConfigError: a negative ``offset`` or a ``limit`` below 1.
            StoreError: the read failed.
        """
        prefix = self._store.url("")
        name = ref[len(prefix) :] if ref.startswith(prefix) else ""
        if not name or "/" in name:
            raise KeyNotFoundError(f"{ref!r} is not an object of {self._store.bucket}")
        data = await self._store.get(name)
        return _slice(data.decode("utf-8", errors="replace"), offset, limit)


async def cut(
    text: str, limit: int, offloader: Offloader | None, key: str
) -> tuple[str, str | None]:
    """Shorten a tool result to ``limit`` characters, offloading the whole of it.

    Args:
        text: the result as the model would see it.
        limit: characters kept (``ContextConfig.tool_result_limit``).
        offloader: where the full text goes; ``None`` drops the rest.
        key: a name for the stored text, unique per result (the ``call_id``).

    Returns:
        ``(text, None)`` if ``text`` fits; else the first ``limit`` characters
        followed by a note for the model (how much was cut, and where to read
        it), and the reference, or ``None`` when nothing was stored. A failing
        offloader is logged, not raised: the model is told the rest is lost.

    Raises:
        ConfigError: a negative ``limit``.
    """
    if limit < 0:
        raise ConfigError(f"limit must be >= 0, not {limit}")
    if len(text) <= limit:
        return text, None
    shown = text[:limit]
    missing = len(text) - limit
    head = f"{_NOTE_START}{missing} of {len(text)}{_NOTE_MARK}"
    if offloader is None:
        return f"{shown}{head}; the rest is not available.]", None
    try:
        ref = await offloader.store(key, text)
    except Exception as exc:
        logger.warning("offloading result %s failed: %r", key, exc, extra={"call_id": key})
        return f"{shown}{head}; the rest could not be stored and is not available.]", None
    note = (
        f"{head}. The full result is stored as {ref}; read more with the tool "
        f'read_offloaded(ref="{ref}", offset={limit}, limit={min(missing, DEFAULT_READ_LIMIT)}).]'
    )
    return f"{shown}{note}", ref


_NOTE_START: Final = "\n\n["
_NOTE_MARK: Final = " characters of this result were cut"


def was_cut(text: str, limit: int) -> bool:
    """Whether ``text`` is what :func:`cut` made of a longer one at ``limit``
    (its first ``limit`` characters, then the note): not to be cut again."""
    note = text[limit : limit + 200]
    return note.startswith(_NOTE_START) and _NOTE_MARK in note


class ReadOffloadedArgs(BaseModel):
    """The arguments of the ``read_offloaded`` tool."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ref: str = Field(min_length=1, description="The reference given in the cut result's note.")
    offset: int = Field(default=0, ge=0, description="The first character to read.")
    limit: int = Field(
        default=DEFAULT_READ_LIMIT,
        ge=1,
        le=MAX_READ_LIMIT,
        description="How many characters to read.",
    )


READ_OFFLOADED_SPEC = ToolSpec(
    name="read_offloaded",
    description=(
        "Read part of a tool result that was too long to show in full. Use the "
        "reference from the note at the end of the cut result, and an offset in "
        "characters (the note says where the shown part ended)."
    ),
    parameters={
        "type": "object",
        "properties": {
            "ref": {"type": "string", "description": "The reference given in the note."},
            "offset": {
                "type": "integer",
                "minimum": 0,
                "default": 0,
                "description": "The first character to read.",
            },
            "limit": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_READ_LIMIT,
                "default": DEFAULT_READ_LIMIT,
                "description": "How many characters to read.",
            },
        },
        "required": ["ref"],
        "additionalProperties": False,
    },
)
"""The ``read_offloaded`` tool, to offer a model along with the agent's tools."""


async def read_offloaded(offloader: Offloader, arguments: Mapping[str, Any]) -> str:
    """Answer a ``read_offloaded`` tool call: the slice, and where to go on.

    Args:
        offloader: where the results were offloaded.
        arguments: the tool_use block's ``input``.

    Returns:
        The text read, followed by a note when more remains.

    Raises:
        pydantic.ValidationError: the arguments do not fit :data:`READ_OFFLOADED_SPEC`.
        KeyNotFoundError: no stored result has that reference.
        StoreError: the read failed.
    """
    args = ReadOffloadedArgs.model_validate(arguments)
    # One character more than asked tells whether anything follows.
    text = await offloader.load(args.ref, args.offset, args.limit + 1)
    if len(text) <= args.limit:
        return text
    end = args.offset + args.limit
    return (
        f"{text[: args.limit]}\n\n[More follows: read_offloaded("
        f'ref="{args.ref}", offset={end}, limit={args.limit}).]'
    )
