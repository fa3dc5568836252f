"""A root directory that file paths may not leave: the sandbox of the file
and coding tools."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Final

from fleetbus.protocol.codec import clip

__all__ = ["MAX_FILE_BYTES", "MAX_PATH_CHARS", "FileSandbox"]

MAX_FILE_BYTES: Final = 512 * 1024
"""Largest file ``read_file`` reads and ``write_file`` writes, in bytes: half of
NATS's default ``max_payload`` (1 MiB), so a read file always fits in its reply."""

MAX_PATH_CHARS: Final = 4096
"""Longest path the file tools accept (Linux's ``PATH_MAX``), in characters;
a longer one is refused before it reaches the file system."""


class FileSandbox:
    """A root directory that paths may not leave.

    Relative paths are taken from the root. An absolute path is allowed when it
    lies inside the root, and refused otherwise, like a ``..`` escape or a
    symlink that points outside: every path is checked after symlinks are
    resolved. The check happens before each operation; a process that swaps a
    directory for a symlink between the check and the operation is out of
    scope (the sandbox guards against a model's mistakes, not local attackers).

    Args:
        root: the root directory; made absolute now, created by :meth:`ensure_root`.
        max_bytes: the largest file read or written, in bytes.
    """

    def __init__(self, root: str | Path, *, max_bytes: int = MAX_FILE_BYTES) -> None:
        self.root = Path(os.path.abspath(Path(root).expanduser()))
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        return f"FileSandbox({str(self.root)!r})"

    def ensure_root(self) -> Path:
        """Create the root directory if needed, and return its real path."""
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root.resolve()

    def resolve(self, path: str | Path) -> Path:
        """The real path of ``path`` inside the root (which need not exist yet).

        Raises:
            PermissionError: the path escapes the root.
            ValueError: the path is malformed, longer than ``MAX_PATH_CHARS``, or
                cannot be resolved (a symlink loop).
        """
        text = str(path)
        if len(text) > MAX_PATH_CHARS:
            raise ValueError(
                f"path {clip(text, 64)!r} is {len(text)} characters long; "
                f"at most {MAX_PATH_CHARS} are accepted"
            )
        if "\x00" in text:
            raise ValueError(f"path {text!r} contains a NUL byte")
        root = self.root.resolve()
        candidate = Path(text)
        try:
            target = (candidate if candidate.is_absolute() else root / candidate).resolve()
        except (RuntimeError, OSError) as exc:
            raise ValueError(f"cannot resolve path {text!r}: {exc}") from None
        if not target.is_relative_to(root):
            raise PermissionError(f"path {text!r} escapes the sandbox root {str(self.root)!r}")
        return target

    def write_text(self, path: str, content: str) -> dict[str, Any]:
        """Write ``content`` (UTF-8) to ``path`` inside the root, creating
        missing parent directories; the relative path and the bytes written.

        Raises:
            ValueError: the path leaves the root, or the content is too big.
            IsADirectoryError: ``path`` is a directory.
        """
        data = content.encode("utf-8")
        if len(data) > self.max_bytes:
            raise ValueError(_too_big(path, len(data), self.max_bytes, "write"))
        self.ensure_root()
        target = self.resolve(path)
        if target.is_dir():
            raise IsADirectoryError(f"{path!r} is a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return {"path": self.relative(target), "bytes": len(data)}

    def relative(self, target: Path) -> str:
        """``target`` (a result of :meth:`resolve`) relative to the root, ``"."`` for the root."""
        return target.relative_to(self.root.resolve()).as_posix()


def _too_big(path: str, size: int, limit: int, verb: str) -> str:
    return f"{path!r} is {size} bytes; {verb}_file handles at most {limit} bytes"
