"""Coding tools: a shell, and files read, written, edited and searched under one root.

The tools are named as in the AgentScope 2.x API: ``Bash``, ``Read``,
``Write``, ``Edit`` and ``Grep``. They work inside the directory named by
``FLEETBUS_CODING_ROOT`` (the working directory at import when unset); make
them for another root with :func:`coding_tools`. Serve them with
``fleetbus worker fleetbus.tools_workers.coding``, which loads this module's
:data:`toolkit`.

Every path argument (``file_path``, ``path``, ``cwd``) goes through a
:class:`~fleetbus.tools_workers.sandbox.FileSandbox`: ``..``, absolute paths
outside the root and symlinks that point outside are refused. ``Grep`` skips
the files under its path that are symlinks to the outside.

``Bash`` is not a sandbox. Its working directory is inside the root, it gets
a minimal environment (``PATH``, ``HOME`` set to the root, ``LANG``,
``TERM=dumb``; none of the worker's variables, so no ``OPENAI_API_KEY`` nor
``FLEETBUS_NATS_*``), its whole process group is killed when it runs past its
timeout or the call is cancelled, and what it prints is capped. But the
command itself can read and write anything the worker's user can.

Confirmation: a tool cannot declare that it must be confirmed; permissions
are the agent's. Give an agent that uses these tools
:func:`fleetbus.agents.permissions.coding_permissions`: ``Read`` and
``Grep`` run, ``Bash``, ``Write`` and ``Edit`` pause the reply for a person
to confirm.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import logging
import os
import re
import signal
import stat
import subprocess
from pathlib import Path
from typing import Annotated, Any, Final

from pydantic import BaseModel, Field

from fleetbus.protocol.codec import clip
from fleetbus.tools_workers.sandbox import FileSandbox
from fleetbus.tools_workers.settings import ToolSettings, check_ranges
from fleetbus.tools_workers.tool import Tool, tool
from fleetbus.tools_workers.toolkit import Toolkit

__all__ = [
    "CODING_ROOT_ENV",
    "DEFAULT_BASH_TIMEOUT",
    "DEFAULT_GREP_RESULTS",
    "DEFAULT_OUTPUT_LIMIT",
    "DEFAULT_READ_LINES",
    "MAX_GREP_RESULTS",
    "coding_tools",
    "toolkit",
]

logger = logging.getLogger(__name__)

CODING_ROOT_ENV: Final = "FLEETBUS_CODING_ROOT"
"""The variable of :attr:`~fleetbus.tools_workers.settings.ToolSettings.coding_root`."""

DEFAULT_BASH_TIMEOUT: Final = 120.0
"""Seconds a ``Bash`` command may run unless :func:`coding_tools` says otherwise."""

DEFAULT_OUTPUT_LIMIT: Final = 30_000
"""Bytes of a ``Bash`` command's output kept (its beginning and its end)."""

DEFAULT_READ_LINES: Final = 2000
"""Lines ``Read`` returns when the call does not say."""

DEFAULT_GREP_RESULTS: Final = 100
"""Matching lines ``Grep`` returns when the call does not say."""

MAX_GREP_RESULTS: Final = 1000
"""The most matching lines one ``Grep`` call may ask for."""

_MATCH_CHARS: Final = 400
"""Longest matching line ``Grep`` returns whole; a longer one is cut."""

_DRAIN_GRACE: Final = 1.0
"""Seconds to collect what is left in the pipe once a command's group is killed;
a process that left the group and keeps the pipe open is not waited for longer."""

_TOOL_GRACE: Final = 5.0
"""Seconds the ``Bash`` tool's own deadline adds to the command's timeout, so
that the command's timeout (which keeps the output) ends it first."""

_BINARY_SNIFF: Final = 8192
_SKIPPED_DIRS: Final = frozenset({".git", ".hg", ".svn"})


def coding_tools(
    root: str | Path | FileSandbox,
    *,
    bash_timeout: float = DEFAULT_BASH_TIMEOUT,
    output_limit: int = DEFAULT_OUTPUT_LIMIT,
) -> Toolkit:
    """The ``Bash``, ``Read``, ``Write``, ``Edit`` and ``Grep`` tools, confined to ``root``.

    Args:
        root: the sandbox, or its root directory (created on first use). The
            sandbox's ``max_bytes`` caps the files read, written, edited and
            searched, and what one ``Read`` returns.
        bash_timeout: the most seconds a ``Bash`` command may run (and its
            default); its process group is killed then.
        output_limit: bytes of a ``Bash`` command's output (stdout and stderr
            together) returned; the middle of a longer output is cut.

    Raises:
        ValueError: ``bash_timeout`` or ``output_limit`` is not positive.
    """
    check_ranges(
        _Limits, "coding_tools", ValueError, bash_timeout=bash_timeout, output_limit=output_limit
    )
    sandbox = root if isinstance(root, FileSandbox) else FileSandbox(root)

    @tool(name="Bash", timeout=bash_timeout + _TOOL_GRACE, concurrency_safe=False)
    async def bash(
        command: str,
        cwd: str = ".",
        timeout: Annotated[float | None, Field(gt=0)] = None,
    ) -> dict[str, Any]:
        """Run a command with bash in the workspace and return its exit code and output.

        stdout and stderr come back together, in the order they were written.
        The environment is minimal: PATH, HOME (the workspace root), LANG and
        TERM=dumb. The command and everything it started are killed when it
        runs past its timeout, and processes it left in the background are
        killed when it ends. A long output keeps its beginning and its end.

        Args:
            command: the bash command line, e.g. "pytest -q tests/test_x.py".
            cwd: the directory to run in, relative to the workspace root.
            timeout: seconds the command may run; the tool's limit when
                omitted, and never more.
        """
        workdir = _directory(sandbox, cwd)
        limit = bash_timeout if timeout is None else min(timeout, bash_timeout)
        return await _run_bash(command, workdir, _bash_env(sandbox), limit, output_limit)

    @tool(name="Read")
    def read(
        file_path: str,
        offset: Annotated[int, Field(ge=0)] = 0,
        limit: Annotated[int, Field(ge=1)] = DEFAULT_READ_LINES,
    ) -> dict[str, Any]:
        """Read lines of a text file in the workspace (UTF-8; undecodable bytes are replaced).

        Returns the text, how many lines it holds, and next_offset: where the
        next call should start to read on, or null at the end of the file.

        Args:
            file_path: the file's path, relative to the workspace root.
            offset: how many lines to skip from the start of the file.
            limit: the most lines to return.
        """
        target = _regular_file(sandbox, file_path)
        cap = sandbox.max_bytes
        taken: list[bytes] = []
        size = 0
        line_no = 0
        next_offset: int | None = None
        with target.open("rb") as f:
            if b"\x00" in f.read(_BINARY_SNIFF):
                raise ValueError(f"{file_path!r} is a binary file")
            f.seek(0)
            # Bounded reads: one huge line must not be loaded whole.
            while piece := f.readline(cap + 1):
                whole = piece.endswith(b"\n") or len(piece) <= cap
                if line_no >= offset:
                    if len(taken) == limit or not whole or size + len(piece) > cap:
                        next_offset = line_no
                        break
                    taken.append(piece)
                    size += len(piece)
                if whole:
                    line_no += 1
        if next_offset == offset:
            raise ValueError(f"line {offset} of {file_path!r} is longer than {cap} bytes")
        return {
            "path": sandbox.relative(target),
            "content": b"".join(taken).decode("utf-8", errors="replace"),
            "offset": offset,
            "lines": len(taken),
            "next_offset": next_offset,
        }

    @tool(name="Write", concurrency_safe=False)
    def write(file_path: str, content: str) -> dict[str, Any]:
        """Write a text file in the workspace (UTF-8), replacing it if it exists.

        Missing parent directories are created.

        Args:
            file_path: the file's path, relative to the workspace root.
            content: the whole new content of the file.
        """
        return sandbox.write_text(file_path, content)

    @tool(name="Edit", concurrency_safe=False)
    def edit(
        file_path: str, old_string: str, new_string: str, replace_all: bool = False
    ) -> dict[str, Any]:
        """Replace exact text in a UTF-8 file of the workspace.

        old_string must occur exactly once, unless replace_all is true: give
        enough surrounding text to make it unique. Whitespace and line breaks
        count.

        Args:
            file_path: the file's path, relative to the workspace root.
            old_string: the text to replace, exactly as it is in the file.
            new_string: the text to put in its place.
            replace_all: replace every occurrence instead of exactly one.
        """
        if not old_string:
            raise ValueError("old_string is empty; use Write to create or replace a whole file")
        if old_string == new_string:
            raise ValueError("old_string and new_string are the same; nothing would change")
        target = _regular_file(sandbox, file_path)
        _check_size(sandbox, file_path, target.stat().st_size)
        try:
            text = target.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{file_path!r} is not UTF-8 text; Edit would corrupt it") from None
        count = text.count(old_string)
        if count == 0:
            raise ValueError(f"old_string not found in {file_path!r}")
        if count > 1 and not replace_all:
            raise ValueError(
                f"old_string occurs {count} times in {file_path!r}; add surrounding text "
                "to make it unique, or set replace_all to replace every occurrence"
            )
        data = text.replace(old_string, new_string).encode("utf-8")
        _check_size(sandbox, file_path, len(data))
        target.write_bytes(data)
        return {"path": sandbox.relative(target), "replacements": count}

    @tool(name="Grep")
    def grep(
        pattern: str,
        path: str = ".",
        glob: str | None = None,
        ignore_case: bool = False,
        max_results: Annotated[int, Field(ge=1, le=MAX_GREP_RESULTS)] = DEFAULT_GREP_RESULTS,
    ) -> dict[str, Any]:
        """Search the text files under a path for lines matching a regular expression.

        Returns the matches (path, line number from 1, line) in path order and
        whether the search stopped at max_results. Binary files, files
        larger than the workspace's file limit and .git, .hg and .svn
        directories are skipped.

        Args:
            pattern: a Python regular expression, e.g. "def \\w+_tool".
            path: a directory (searched recursively) or a file, relative to
                the workspace root.
            glob: only files whose name or relative path matches this glob,
                e.g. "*.py" (a * also matches /).
            ignore_case: match letters of either case.
            max_results: the most matching lines to return.
        """
        try:
            regex = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
        except re.error as exc:
            raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from None
        sandbox.ensure_root()
        start = sandbox.resolve(path)
        if not start.exists():
            raise FileNotFoundError(f"no such file or directory: {path!r}")
        matches: list[dict[str, Any]] = []
        searched = 0
        for target in _files_under(sandbox, start):
            relative = sandbox.relative(target)
            if glob is not None and not (
                fnmatch.fnmatchcase(target.name, glob) or fnmatch.fnmatchcase(relative, glob)
            ):
                continue
            text = _searchable_text(sandbox, target)
            if text is None:
                continue
            searched += 1
            for number, line in enumerate(text.splitlines(), start=1):
                if regex.search(line):
                    if len(matches) == max_results:
                        return {"matches": matches, "truncated": True, "files_searched": searched}
                    matches.append(
                        {"path": relative, "line": number, "text": clip(line, _MATCH_CHARS)}
                    )
        return {"matches": matches, "truncated": False, "files_searched": searched}

    tools: list[Tool] = [bash, read, write, edit, grep]
    return Toolkit(tools)


class _Limits(BaseModel):
    bash_timeout: float = Field(gt=0)
    output_limit: int = Field(ge=1)


def _check_size(sandbox: FileSandbox, path: str, size: int) -> None:
    if size > sandbox.max_bytes:
        raise ValueError(f"{path!r} would be {size} bytes; at most {sandbox.max_bytes} are allowed")


def _regular_file(sandbox: FileSandbox, path: str) -> Path:
    """The real path of an existing regular file inside the root, not too big."""
    sandbox.ensure_root()
    target = sandbox.resolve(path)
    try:
        info = target.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"no such file: {path!r}") from None
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(f"{path!r} is a directory")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path!r} is not a regular file")
    return target


def _directory(sandbox: FileSandbox, path: str) -> Path:
    sandbox.ensure_root()
    target = sandbox.resolve(path)
    if not target.is_dir():
        raise NotADirectoryError(f"{path!r} is not a directory of the workspace")
    return target


def _files_under(sandbox: FileSandbox, start: Path) -> list[Path]:
    """The regular files at or under ``start``, sorted, none outside the root."""
    if not start.is_dir():
        return [start]
    found: list[Path] = []
    for folder, dirs, files in os.walk(start):  # symlinked directories are not entered
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        for name in sorted(files):
            try:
                found.append(sandbox.resolve(Path(folder, name)))
            except (PermissionError, ValueError):
                continue  # a symlink to the outside, or a loop
    return found


def _searchable_text(sandbox: FileSandbox, target: Path) -> str | None:
    """The text of a file Grep searches, or ``None`` for one it skips."""
    try:
        info = target.stat()
        if not stat.S_ISREG(info.st_mode) or info.st_size > sandbox.max_bytes:
            return None
        data = target.read_bytes()
    except OSError:
        return None  # vanished or unreadable since the walk
    if b"\x00" in data[:_BINARY_SNIFF]:
        return None
    return data.decode("utf-8", errors="replace")


def _bash_env(sandbox: FileSandbox) -> dict[str, str]:
    """The whole environment of a command: nothing of the worker's but PATH."""
    return {
        "PATH": os.environ.get("PATH") or os.defpath,
        "HOME": str(sandbox.root),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
    }


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _run_bash(
    command: str, cwd: Path, env: dict[str, str], timeout: float, output_limit: int
) -> dict[str, Any]:
    """Run ``bash -c command`` in a session of its own; kill that whole group
    when it ends, times out, or this coroutine is cancelled."""
    captured = _Capture(output_limit)
    loop = asyncio.get_running_loop()
    transport, bash = await loop.subprocess_exec(
        lambda: _BashProtocol(captured),
        "bash",
        "-c",
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, to kill with its children
    )
    pgid = transport.get_pid()
    timed_out = False
    try:
        try:
            async with asyncio.timeout(timeout):
                # Bash's exit, not the pipe's end: a process left in the
                # background keeps the pipe open.
                await bash.exited.wait()
        except TimeoutError:
            timed_out = True
        _kill_group(pgid)
        try:
            async with asyncio.timeout(_DRAIN_GRACE):
                await bash.output_closed.wait()
        except TimeoutError:
            pass  # a process that left the group holds the pipe; keep what came
    finally:
        _kill_group(pgid)
        # Reaped before the transport closes, even when cancelled: a process
        # left to the child watcher outlives the call (and the loop, in tests).
        try:
            async with asyncio.timeout(_DRAIN_GRACE):
                await bash.exited.wait()  # SIGKILLed: at once
        except TimeoutError:
            logger.warning("bash (pid %d) still runs after SIGKILL", pgid)
        transport.close()
    output, cut = captured.text()
    if timed_out:
        output += f"\n[killed after {timeout:g}s]"
    return {
        "exit_code": transport.get_returncode(),
        "output": output,
        "timed_out": timed_out,
        "truncated_bytes": cut,
    }


class _BashProtocol(asyncio.SubprocessProtocol):
    """Collects a command's output and says when bash exited and when the
    output pipe closed."""

    def __init__(self, captured: _Capture) -> None:
        self.captured = captured
        self.exited = asyncio.Event()
        self.output_closed = asyncio.Event()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.captured.add(data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self.output_closed.set()

    def process_exited(self) -> None:
        self.exited.set()


class _Capture:
    """A command's output, capped: its first bytes and its last bytes."""

    def __init__(self, limit: int) -> None:
        self.head_size = limit - limit // 2
        self.tail_size = limit // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_size - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail_size:
            self.tail += chunk
            del self.tail[: -self.tail_size]

    def text(self) -> tuple[str, int]:
        """The output kept, with a note where the middle was cut, and how many bytes were cut."""
        cut = self.total - len(self.head) - len(self.tail)
        if cut == 0:
            return (self.head + self.tail).decode("utf-8", errors="replace"), 0
        head = self.head.decode("utf-8", errors="replace")
        tail = self.tail.decode("utf-8", errors="replace")
        return f"{head}\n[... {cut} bytes of output cut ...]\n{tail}", cut


toolkit = coding_tools(ToolSettings().coding_root or os.getcwd())
"""The coding tools, served by ``fleetbus worker fleetbus.tools_workers.coding``."""
