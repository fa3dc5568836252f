"""The built-in tools: a calculator, the current time, and files in a sandbox.

Serve them all with ``fleetbus worker fleetbus.tools_workers.builtin``, which
loads this module's :data:`toolkit`. The file tools work inside the directory
named by ``FLEETBUS_FILES_ROOT`` (``./workspace`` by default), created on first
use, never at import.
"""

from __future__ import annotations

import os
import stat
from datetime import datetime
from pathlib import Path
from typing import Any, Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from fleetbus.tools_workers._calculator import evaluate
from fleetbus.tools_workers.sandbox import MAX_FILE_BYTES, MAX_PATH_CHARS, FileSandbox, _too_big
from fleetbus.tools_workers.settings import ToolSettings
from fleetbus.tools_workers.tool import Tool, tool
from fleetbus.tools_workers.toolkit import Toolkit

__all__ = [
    "DEFAULT_FILES_ROOT",
    "FILES_ROOT_ENV",
    "MAX_FILE_BYTES",
    "MAX_LIST_ENTRIES",
    "MAX_PATH_CHARS",
    "FileSandbox",
    "builtin_toolkit",
    "calculator",
    "current_time",
    "file_tools",
    "toolkit",
]

FILES_ROOT_ENV: Final = "FLEETBUS_FILES_ROOT"
"""The variable of :attr:`~fleetbus.tools_workers.settings.ToolSettings.files_root`."""

DEFAULT_FILES_ROOT: Final[str] = ToolSettings.model_fields["files_root"].default
"""Root of the file tools when ``FLEETBUS_FILES_ROOT`` is unset, under the current directory."""

MAX_LIST_ENTRIES: Final = 1000
"""Most entries ``list_dir`` returns; a bigger directory is an error."""


@tool(blocking=False)  # bounded arithmetic (at most a millisecond): no thread needed
def calculator(expr: str) -> int | float:
    """Evaluate an arithmetic expression exactly and safely.

    Accepts numbers, + - * / // % ** and parentheses, the constants pi, e and
    tau, and the functions abs, round, min, max, sqrt, exp, log, log10, log2,
    sin, cos, tan, floor and ceil. Integer arithmetic is exact ("7 - 4" gives
    3); "/" gives a float. Integers are limited to 10**1000.

    Args:
        expr: the expression in Python syntax, e.g. "3 * (4 + 5)" or "sqrt(2) / 2".
    """
    return evaluate(expr)


@tool
def current_time(timezone: str = "UTC") -> dict[str, Any]:
    """The current date and time in a time zone.

    Returns the zone, the time as an RFC 3339 string, the Unix timestamp in
    seconds, and the weekday.

    Args:
        timezone: an IANA time zone name, e.g. "UTC", "Europe/Paris" or "America/New_York".
    """
    try:
        zone = ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(
            f"unknown time zone {timezone!r}; give an IANA name such as 'UTC' or 'Europe/Paris'"
        ) from None
    now = datetime.now(zone)
    return {
        "timezone": zone.key,
        "iso": now.isoformat(),
        "unix": now.timestamp(),
        "weekday": now.strftime("%A"),
    }


def file_tools(root: str | Path | FileSandbox) -> list[Tool]:
    """The ``read_file``, ``write_file`` and ``list_dir`` tools, confined to ``root``.

    Args:
        root: the sandbox, or its root directory (created on first use).
    """
    sandbox = root if isinstance(root, FileSandbox) else FileSandbox(root)

    @tool(name="read_file")
    def read_file(path: str) -> str:
        """Read a text file from the workspace (UTF-8; undecodable bytes are replaced).

        Args:
            path: the file's path, relative to the workspace root.
        """
        sandbox.ensure_root()
        target = sandbox.resolve(path)
        try:
            info = target.stat()
        except FileNotFoundError:
            raise FileNotFoundError(f"no such file: {path!r}") from None
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(f"{path!r} is a directory; use list_dir")
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path!r} is not a regular file")
        if info.st_size > sandbox.max_bytes:
            raise ValueError(_too_big(path, info.st_size, sandbox.max_bytes, "read"))
        with target.open("rb") as f:
            data = f.read(sandbox.max_bytes + 1)
        if len(data) > sandbox.max_bytes:  # it grew since stat()
            raise ValueError(_too_big(path, len(data), sandbox.max_bytes, "read"))
        return data.decode("utf-8", errors="replace")

    @tool(name="write_file", concurrency_safe=False)
    def write_file(path: str, content: str) -> dict[str, Any]:
        """Write a text file in the workspace (UTF-8), replacing it if it exists.

        Missing parent directories are created.

        Args:
            path: the file's path, relative to the workspace root.
            content: the whole new content of the file.
        """
        return sandbox.write_text(path, content)

    @tool(name="list_dir")
    def list_dir(path: str = ".") -> list[dict[str, Any]]:
        """List a directory of the workspace, sorted by name.

        Each entry has a name, a type ("file", "dir", "symlink" or "other") and
        a size in bytes (0 for anything but files).

        Args:
            path: the directory's path, relative to the workspace root.
        """
        sandbox.ensure_root()
        target = sandbox.resolve(path)
        if not target.exists():
            raise FileNotFoundError(f"no such directory: {path!r}")
        if not target.is_dir():
            raise NotADirectoryError(f"{path!r} is not a directory; use read_file")
        entries: list[os.DirEntry[str]] = []
        with os.scandir(target) as it:
            for entry in it:
                if len(entries) == MAX_LIST_ENTRIES:
                    raise ValueError(
                        f"{path!r} holds more than {MAX_LIST_ENTRIES} entries; "
                        "list a subdirectory instead"
                    )
                entries.append(entry)
        return [_describe_entry(e) for e in sorted(entries, key=lambda e: e.name)]

    return [read_file, write_file, list_dir]


def _describe_entry(entry: os.DirEntry[str]) -> dict[str, Any]:
    # Symlinks are not followed: their target may lie outside the sandbox.
    info = entry.stat(follow_symlinks=False)
    if stat.S_ISREG(info.st_mode):
        kind, size = "file", info.st_size
    elif stat.S_ISDIR(info.st_mode):
        kind, size = "dir", 0
    elif stat.S_ISLNK(info.st_mode):
        kind, size = "symlink", 0
    else:
        kind, size = "other", 0
    return {"name": entry.name, "type": kind, "size": size}


def builtin_toolkit(files_root: str | Path | None = None) -> Toolkit:
    """A toolkit of every built-in tool.

    Args:
        files_root: the root of the file tools; by default ``$FLEETBUS_FILES_ROOT``,
            else ``./workspace``. It is created on first use, not here.
    """
    if files_root is None:
        files_root = ToolSettings().files_root
    return Toolkit([calculator, current_time, *file_tools(files_root)])


toolkit = builtin_toolkit()
"""The built-in tools, served by ``fleetbus worker fleetbus.tools_workers.builtin``."""
