"""The file tools stay inside their sandbox root; current_time speaks IANA zones.

Absolute paths are allowed when they lie inside the root (after symlinks are
resolved) and refused otherwise.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from fleetbus.protocol import ToolResult
from fleetbus.tools_workers import Tool
from fleetbus.tools_workers.builtin import (
    FILES_ROOT_ENV,
    FileSandbox,
    builtin_toolkit,
    current_time,
    file_tools,
    toolkit,
)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret.txt").write_text("top secret")
    return path


@pytest.fixture
def tools(root: Path) -> dict[str, Tool]:
    return {t.name: t for t in file_tools(root)}


def _error(outcome: ToolResult) -> str:
    assert outcome.status == "error"
    assert outcome.error_detail is not None
    assert outcome.error_detail.code == "tool_error"
    return outcome.error_detail.message


@pytest.mark.parametrize("path", ["..", "../x", "a/../../x", "/etc/passwd", "./../root2/x"])
def test_resolve_refuses_escapes(root: Path, path: str) -> None:
    with pytest.raises(PermissionError, match="escapes the sandbox root"):
        FileSandbox(root).resolve(path)


def test_resolve_refuses_an_absolute_path_outside(root: Path, outside: Path) -> None:
    with pytest.raises(PermissionError, match="escapes the sandbox root"):
        FileSandbox(root).resolve(outside / "secret.txt")


def test_resolve_allows_paths_inside(root: Path) -> None:
    sandbox = FileSandbox(root)
    real = root.resolve()
    assert sandbox.resolve(".") == real
    assert sandbox.resolve("") == real
    assert sandbox.resolve("a/b/../c.txt") == real / "a" / "c.txt"
    assert sandbox.resolve(str(root / "x.txt")) == real / "x.txt"  # absolute, inside


def test_resolve_refuses_a_symlink_pointing_outside(root: Path, outside: Path) -> None:
    (root / "link").symlink_to(outside)
    (root / "file-link").symlink_to(outside / "secret.txt")
    sandbox = FileSandbox(root)
    for path in ("link", "link/secret.txt", "file-link"):
        with pytest.raises(PermissionError, match="escapes the sandbox root"):
            sandbox.resolve(path)


def test_resolve_follows_a_symlink_inside(root: Path) -> None:
    (root / "real").mkdir()
    (root / "alias").symlink_to(root / "real")
    assert FileSandbox(root).resolve("alias/x") == root.resolve() / "real" / "x"


def test_a_root_reached_through_a_symlink_works(tmp_path: Path, root: Path) -> None:
    (tmp_path / "via").symlink_to(root)
    sandbox = FileSandbox(tmp_path / "via")
    assert sandbox.resolve("x") == root.resolve() / "x"
    with pytest.raises(PermissionError):
        sandbox.resolve("../x")  # tmp_path/x, whether ".." is taken from "via" or "root"


def test_resolve_refuses_nul_bytes(root: Path) -> None:
    with pytest.raises(ValueError, match="NUL"):
        FileSandbox(root).resolve("a\x00b")


async def test_write_read_and_list(tools: dict[str, Tool], root: Path) -> None:
    written = await tools["write_file"].run({"path": "notes/a.txt", "content": "héllo"})
    assert written.status == "success"
    assert written.content == {"path": "notes/a.txt", "bytes": 6}
    assert (root / "notes" / "a.txt").read_text(encoding="utf-8") == "héllo"

    read = await tools["read_file"].run({"path": "notes/a.txt"})
    assert read.status == "success"
    assert read.content == "héllo"

    (root / "b.txt").write_bytes(b"12345")
    listed = await tools["list_dir"].run({})
    assert listed.content == [
        {"name": "b.txt", "type": "file", "size": 5},
        {"name": "notes", "type": "dir", "size": 0},
    ]
    listed = await tools["list_dir"].run({"path": "notes"})
    assert listed.content == [{"name": "a.txt", "type": "file", "size": 6}]


async def test_write_replaces_a_file(tools: dict[str, Tool], root: Path) -> None:
    await tools["write_file"].run({"path": "a.txt", "content": "first version"})
    await tools["write_file"].run({"path": "a.txt", "content": "second"})
    assert (root / "a.txt").read_text() == "second"


def test_tools_are_callable_directly(tools: dict[str, Tool]) -> None:
    assert tools["write_file"]("x.txt", "x") == {"path": "x.txt", "bytes": 1}
    assert tools["read_file"]("x.txt") == "x"
    assert tools["list_dir"]() == [{"name": "x.txt", "type": "file", "size": 1}]


async def test_read_replaces_undecodable_bytes(tools: dict[str, Tool], root: Path) -> None:
    (root / "bin").write_bytes(b"ok\xff")
    outcome = await tools["read_file"].run({"path": "bin"})
    assert outcome.content == "ok\ufffd"


@pytest.mark.parametrize("path", ["../x.txt", "a/../../x.txt", "{tmp_path}/x.txt"])
async def test_write_refuses_escapes(tools: dict[str, Tool], tmp_path: Path, path: str) -> None:
    path = path.format(tmp_path=tmp_path)
    message = _error(await tools["write_file"].run({"path": path, "content": "x"}))
    assert message.startswith("PermissionError: path ")
    assert "escapes the sandbox root" in message
    assert not (tmp_path / "x.txt").exists()


async def test_tools_refuse_a_symlink_pointing_outside(
    tools: dict[str, Tool], root: Path, outside: Path
) -> None:
    (root / "link").symlink_to(outside)
    read = await tools["read_file"].run({"path": "link/secret.txt"})
    assert "escapes the sandbox root" in _error(read)
    write = await tools["write_file"].run({"path": "link/new.txt", "content": "x"})
    assert "escapes the sandbox root" in _error(write)
    assert not (outside / "new.txt").exists()
    assert "escapes" in _error(await tools["list_dir"].run({"path": "link"}))


async def test_list_does_not_follow_symlinks(
    tools: dict[str, Tool], root: Path, outside: Path
) -> None:
    (root / "link").symlink_to(outside / "secret.txt")
    outcome = await tools["list_dir"].run({"path": "."})
    assert outcome.content == [{"name": "link", "type": "symlink", "size": 0}]


async def test_read_refuses_a_file_over_the_limit(root: Path) -> None:
    read_file = {t.name: t for t in file_tools(FileSandbox(root, max_bytes=10))}["read_file"]
    (root / "small").write_bytes(b"x" * 10)
    (root / "big").write_bytes(b"x" * 11)
    assert (await read_file.run({"path": "small"})).content == "x" * 10
    message = _error(await read_file.run({"path": "big"}))
    assert "is 11 bytes" in message
    assert "at most 10 bytes" in message


async def test_read_refuses_more_than_half_a_mebibyte_by_default(
    tools: dict[str, Tool], root: Path
) -> None:
    (root / "big").write_bytes(b"x" * (512 * 1024 + 1))
    assert "at most 524288 bytes" in _error(await tools["read_file"].run({"path": "big"}))


async def test_write_refuses_content_over_the_limit(root: Path) -> None:
    write_file = {t.name: t for t in file_tools(FileSandbox(root, max_bytes=4))}["write_file"]
    message = _error(await write_file.run({"path": "f", "content": "ééé"}))
    assert "is 6 bytes" in message
    assert not (root / "f").exists()


async def test_clear_errors_for_wrong_kinds(tools: dict[str, Tool], root: Path) -> None:
    (root / "d").mkdir()
    (root / "f").write_text("x")
    assert "no such file" in _error(await tools["read_file"].run({"path": "missing"}))
    assert "IsADirectoryError" in _error(await tools["read_file"].run({"path": "d"}))
    assert "NotADirectoryError" in _error(await tools["list_dir"].run({"path": "f"}))
    assert "no such directory" in _error(await tools["list_dir"].run({"path": "missing"}))
    assert "IsADirectoryError" in _error(
        await tools["write_file"].run({"path": ".", "content": "x"})
    )


async def test_the_root_is_created_on_first_use_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(FILES_ROOT_ENV, raising=False)
    kit = builtin_toolkit()
    assert not (tmp_path / "workspace").exists()
    assert (await kit.run("list_dir", {})).content == []
    assert (tmp_path / "workspace").is_dir()


async def test_the_root_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FILES_ROOT_ENV, str(tmp_path / "files"))
    kit = builtin_toolkit()
    outcome = await kit.run("write_file", {"path": "a/b.txt", "content": "hi"})
    assert outcome.content == {"path": "a/b.txt", "bytes": 2}
    assert (tmp_path / "files" / "a" / "b.txt").read_text() == "hi"


def test_the_module_toolkit_holds_every_builtin_tool() -> None:
    assert toolkit.names == ["calculator", "current_time", "read_file", "write_file", "list_dir"]


@pytest.mark.parametrize(
    ("zone", "offset"),
    [
        ("UTC", timedelta(0)),
        ("Asia/Tokyo", timedelta(hours=9)),
        ("Asia/Kolkata", timedelta(hours=5, minutes=30)),
    ],
)
async def test_current_time(zone: str, offset: timedelta) -> None:
    outcome = await current_time.run({"timezone": zone})
    assert outcome.status == "success"
    assert outcome.content["timezone"] == zone
    now = datetime.fromisoformat(outcome.content["iso"])
    assert now.utcoffset() == offset
    assert abs(outcome.content["unix"] - time.time()) < 5
    assert abs(now.timestamp() - outcome.content["unix"]) < 1e-3


async def test_current_time_defaults_to_utc() -> None:
    outcome = await current_time.run({})
    assert outcome.content["timezone"] == "UTC"


@pytest.mark.parametrize(
    "zone", ["Mars/Olympus_Mons", "", "../../etc/passwd", "/etc/localtime", "America"]
)
async def test_current_time_refuses_an_unknown_zone(zone: str) -> None:
    message = _error(await current_time.run({"timezone": zone}))
    assert message.startswith(f"ValueError: unknown time zone {zone!r}")
