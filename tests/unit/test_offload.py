"""Offloading long tool results: files in a directory, cutting with a note,
and the read_offloaded tool."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from fleetbus.agents.offload import (
    READ_OFFLOADED_SPEC,
    DirectoryOffloader,
    Offloader,
    ReadOffloadedArgs,
    cut,
    read_offloaded,
)
from fleetbus.errors import ConfigError, KeyNotFoundError

TEXT = "".join(f"{i:05d}" for i in range(10_000))  # 50,000 characters, each slice unique


async def test_directory_offloader_stores_lazily_and_loads_slices(tmp_path: Path) -> None:
    root = tmp_path / "offload"
    offloader = DirectoryOffloader(root)
    assert isinstance(offloader, Offloader)
    assert not root.exists()
    ref = await offloader.store("call-1", TEXT)
    assert ref == "file:call-1"
    assert (root / "call-1").read_text(encoding="utf-8") == TEXT
    assert await offloader.load(ref) == TEXT[:20_000]
    assert await offloader.load(ref, offset=100, limit=10) == TEXT[100:110]
    assert await offloader.load(ref, offset=49_995) == TEXT[49_995:]
    assert await offloader.load(ref, offset=60_000) == ""
    assert [p.name for p in root.iterdir()] == ["call-1"]  # no temporary files left
    assert await offloader.store("call-1", "replaced") == ref
    assert await offloader.load(ref) == "replaced"


async def test_directory_offloader_keeps_non_ascii_text(tmp_path: Path) -> None:
    offloader = DirectoryOffloader(tmp_path)
    ref = await offloader.store("u", "héllo wörld ✓")
    assert await offloader.load(ref, offset=6, limit=5) == "wörld"


async def test_unsafe_keys_get_distinct_safe_names(tmp_path: Path) -> None:
    offloader = DirectoryOffloader(tmp_path / "root")
    refs = {
        key: await offloader.store(key, f"data of {key}")
        for key in ["a/b", "a_b", "../up", "", ".hidden"]
    }
    assert len(set(refs.values())) == len(refs)
    for key, ref in refs.items():
        assert await offloader.load(ref) == f"data of {key}"
    assert {p.parent for p in (tmp_path / "root").iterdir()} == {tmp_path / "root"}
    assert not (tmp_path / "up").exists()


async def test_directory_offloader_refuses_unknown_and_escaping_refs(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("secret", encoding="utf-8")
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "x").write_text("nested", encoding="utf-8")
    (root / "link").symlink_to(tmp_path / "secret")
    offloader = DirectoryOffloader(root)
    with pytest.raises(KeyNotFoundError, match="nothing is stored as 'file:missing'"):
        await offloader.load("file:missing")
    with pytest.raises(KeyNotFoundError, match="not a file: reference"):
        await offloader.load("nats-object://b/x")
    for ref in ["file:../secret", f"file:{tmp_path / 'secret'}", "file:sub/x", "file:link"]:
        with pytest.raises(KeyNotFoundError, match="outside the offload directory"):
            await offloader.load(ref)
    for ref in ["file:", "file:.", "file:.."]:
        with pytest.raises(KeyNotFoundError):
            await offloader.load(ref)


async def test_load_rejects_bad_ranges(tmp_path: Path) -> None:
    offloader = DirectoryOffloader(tmp_path)
    ref = await offloader.store("k", "abc")
    with pytest.raises(ConfigError, match="offset >= 0"):
        await offloader.load(ref, offset=-1)
    with pytest.raises(ConfigError, match="limit >= 1"):
        await offloader.load(ref, limit=0)


async def test_cut_leaves_short_text_alone(tmp_path: Path) -> None:
    offloader = DirectoryOffloader(tmp_path)
    assert await cut("short", 5, offloader, "k") == ("short", None)
    assert await cut("", 0, None, "k") == ("", None)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError):
        await cut("x", -1, None, "k")


async def test_cut_without_an_offloader_says_the_rest_is_lost() -> None:
    shown, ref = await cut(TEXT, 1_000, None, "call-1")
    assert ref is None
    assert shown.startswith(TEXT[:1_000])
    assert shown[1_000:] == (
        "\n\n[49000 of 50000 characters of this result were cut; the rest is not available.]"
    )


async def test_cut_with_an_offloader_stores_everything_and_tells_how_to_read(
    tmp_path: Path,
) -> None:
    offloader = DirectoryOffloader(tmp_path)
    shown, ref = await cut(TEXT, 1_000, offloader, "call-1")
    assert ref == "file:call-1"
    assert shown.startswith(TEXT[:1_000])
    note = shown[1_000:]
    assert "49000 of 50000 characters" in note
    assert 'read_offloaded(ref="file:call-1", offset=1000, limit=20000)' in note
    assert await offloader.load(ref, 0, len(TEXT)) == TEXT


async def test_cut_survives_a_failing_offloader() -> None:
    class Broken:
        async def store(self, key: str, data: str) -> str:
            raise OSError("disk full")

        async def load(self, ref: str, offset: int = 0, limit: int = 20_000) -> str:
            raise AssertionError("not called")

    shown, ref = await cut("x" * 20, 10, Broken(), "k")
    assert ref is None
    assert shown == "x" * 10 + (
        "\n\n[10 of 20 characters of this result were cut; "
        "the rest could not be stored and is not available.]"
    )


def test_read_offloaded_spec_matches_its_argument_model() -> None:
    assert READ_OFFLOADED_SPEC.name == "read_offloaded"
    params = READ_OFFLOADED_SPEC.parameters
    assert params["required"] == ["ref"]
    assert params["properties"]["offset"]["minimum"] == 0
    assert params["properties"]["limit"]["maximum"] == 100_000
    assert ReadOffloadedArgs(ref="r") == ReadOffloadedArgs(ref="r", offset=0, limit=20_000)
    for bad in [
        {"ref": "r", "offset": -1},
        {"ref": "r", "limit": 0},
        {"ref": "r", "limit": 100_001},
    ]:
        with pytest.raises(ValidationError):
            ReadOffloadedArgs.model_validate(bad)


async def test_read_offloaded_answers_a_tool_call_and_says_where_to_go_on(
    tmp_path: Path,
) -> None:
    offloader = DirectoryOffloader(tmp_path)
    ref = await offloader.store("call-1", TEXT)
    first = await read_offloaded(offloader, {"ref": ref, "offset": 1_000, "limit": 100})
    assert first == TEXT[1_000:1_100] + (
        '\n\n[More follows: read_offloaded(ref="file:call-1", offset=1100, limit=100).]'
    )
    last = await read_offloaded(offloader, {"ref": ref, "offset": 49_900, "limit": 100})
    assert last == TEXT[49_900:]
    with pytest.raises(KeyNotFoundError):
        await read_offloaded(offloader, {"ref": "file:nope"})
    with pytest.raises(ValidationError):
        await read_offloaded(offloader, {"offset": 3})
