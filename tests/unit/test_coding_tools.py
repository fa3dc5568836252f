"""The coding tools (Bash, Read, Write, Edit, Grep) stay inside their root,
Bash's timeout, output cap and bare environment hold, and Edit refuses
ambiguous and absent replacements."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from fleetbus.agents.permissions import coding_permissions
from fleetbus.protocol import ToolResult
from fleetbus.tools_workers import Toolkit, coding
from fleetbus.tools_workers.builtin import FileSandbox
from fleetbus.tools_workers.coding import coding_tools


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret.txt").write_text("top secret needle\n")
    return path


@pytest.fixture
def tools(root: Path) -> Toolkit:
    return coding_tools(root, bash_timeout=10)


async def _ok(tools: Toolkit, name: str, **parameters: Any) -> Any:
    outcome = await tools.get(name).run(parameters)
    assert outcome.status == "success", outcome.error_detail
    return outcome.content


async def _fails(tools: Toolkit, name: str, **parameters: Any) -> str:
    outcome: ToolResult = await tools.get(name).run(parameters)
    assert outcome.status == "error", outcome.content
    assert outcome.error_detail is not None
    return outcome.error_detail.message


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper is dead)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"


def _dies_within(pid: int, seconds: float) -> bool:
    # The group was killed; reaping it by init may take a moment.
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_toolkit_has_the_five_tools() -> None:
    assert sorted(t.name for t in coding.toolkit) == ["Bash", "Edit", "Grep", "Read", "Write"]
    assert coding.toolkit.get("Bash").concurrency_safe is False
    assert coding.toolkit.get("Read").concurrency_safe is True


def test_bash_tool_deadline_leaves_room_for_its_own_timeout(root: Path) -> None:
    bash = coding_tools(root, bash_timeout=7).get("Bash")
    assert bash.timeout is not None
    assert bash.timeout > 7


@pytest.mark.parametrize("value", [0, -1.0])
def test_coding_tools_refuses_a_nonpositive_timeout(root: Path, value: float) -> None:
    with pytest.raises(
        ValueError, match=r"^coding_tools: bash_timeout: Input should be greater than 0"
    ):
        coding_tools(root, bash_timeout=value)


def test_coding_permissions_allow_reads_and_ask_before_changes() -> None:
    permissions = coding_permissions()
    decisions = {name: permissions.check(name, {}).action for name in ("Read", "Grep")}
    decisions |= {name: permissions.check(name, {}).action for name in ("Bash", "Write", "Edit")}
    assert decisions == {
        "Read": "allow",
        "Grep": "allow",
        "Bash": "ask",
        "Write": "ask",
        "Edit": "ask",
    }


def test_coding_permissions_are_new_on_each_call() -> None:
    first = coding_permissions()
    first.allow("Bash")  # what a confirmation with always=True does to an agent's rules
    assert coding_permissions().check("Bash", {}).action == "ask"


# Bash


async def test_bash_returns_exit_code_and_both_streams(tools: Toolkit) -> None:
    result = await _ok(tools, "Bash", command="echo out; echo err >&2; exit 3")
    assert result["exit_code"] == 3
    assert result["output"] == "out\nerr\n"
    assert result["timed_out"] is False


async def test_bash_runs_in_the_root_and_in_a_cwd_inside_it(tools: Toolkit, root: Path) -> None:
    (root / "sub").mkdir()
    assert (await _ok(tools, "Bash", command="pwd"))["output"] == f"{root}\n"
    assert (await _ok(tools, "Bash", command="pwd", cwd="sub"))["output"] == f"{root / 'sub'}\n"
    inside = await _ok(tools, "Bash", command="pwd", cwd=str(root / "sub"))
    assert inside["output"] == f"{root / 'sub'}\n"


@pytest.mark.parametrize("cwd", ["..", "sub/../..", "/", "/tmp"])
async def test_bash_refuses_a_cwd_outside_the_root(tools: Toolkit, root: Path, cwd: str) -> None:
    (root / "sub").mkdir()
    assert "escapes the sandbox root" in await _fails(tools, "Bash", command="pwd", cwd=cwd)


async def test_bash_refuses_a_cwd_symlinked_outside(
    tools: Toolkit, root: Path, outside: Path
) -> None:
    (root / "link").symlink_to(outside, target_is_directory=True)
    message = await _fails(tools, "Bash", command="touch made-here", cwd="link")
    assert "escapes the sandbox root" in message
    assert not (outside / "made-here").exists()


async def test_bash_refuses_a_cwd_that_is_a_file(tools: Toolkit, root: Path) -> None:
    (root / "f.txt").write_text("x")
    assert "not a directory" in await _fails(tools, "Bash", command="pwd", cwd="f.txt")


async def test_bash_timeout_kills_the_command_and_its_children(root: Path) -> None:
    tools = coding_tools(root, bash_timeout=1.0)
    started = time.monotonic()
    result = await _ok(tools, "Bash", command="sleep 30 & echo $! > child.pid; sleep 30")
    elapsed = time.monotonic() - started
    assert result["timed_out"] is True
    assert result["exit_code"] == -9
    assert "[killed after 1s]" in result["output"]
    assert 0.9 < elapsed < 4
    child = int((root / "child.pid").read_text())
    assert _dies_within(child, 2.0)


async def test_bash_timeout_argument_is_shorter_never_longer(root: Path) -> None:
    tools = coding_tools(root, bash_timeout=1.0)
    started = time.monotonic()
    assert (await _ok(tools, "Bash", command="sleep 30", timeout=0.3))["timed_out"] is True
    assert time.monotonic() - started < 0.9
    started = time.monotonic()
    assert (await _ok(tools, "Bash", command="sleep 30", timeout=100))["timed_out"] is True
    assert time.monotonic() - started < 4


async def test_bash_kills_what_the_command_left_in_the_background(
    tools: Toolkit, root: Path
) -> None:
    started = time.monotonic()
    result = await _ok(tools, "Bash", command="sleep 30 & echo $! > child.pid; echo done")
    assert time.monotonic() - started < 3
    assert result == {"exit_code": 0, "output": "done\n", "timed_out": False, "truncated_bytes": 0}
    child = int((root / "child.pid").read_text())
    assert _dies_within(child, 2.0)


async def test_bash_cancelled_by_the_tool_deadline_kills_its_group(
    tools: Toolkit, root: Path
) -> None:
    started = time.monotonic()
    outcome = await tools.get("Bash").run(
        {"command": "sleep 30 & echo $! > child.pid; sleep 30"}, timeout=0.5
    )
    assert outcome.status == "timeout"
    assert time.monotonic() - started < 3
    assert _dies_within(int((root / "child.pid").read_text()), 2.0)


async def test_bash_caps_its_output_keeping_both_ends(root: Path) -> None:
    tools = coding_tools(root, output_limit=1000)
    command = "echo FIRST; head -c 100000 /dev/zero | tr '\\0' a; echo; echo LAST >&2"
    result = await _ok(tools, "Bash", command=command)
    total = len("FIRST\n") + 100_000 + len("\n") + len("LAST\n")
    assert result["truncated_bytes"] == total - 1000
    output = result["output"]
    assert output.startswith("FIRST\n")
    assert output.endswith("LAST\n")
    assert f"[... {total - 1000} bytes of output cut ...]" in output
    assert len(output) < 1100


async def test_bash_output_under_the_cap_is_whole(root: Path) -> None:
    tools = coding_tools(root, output_limit=1000)
    result = await _ok(tools, "Bash", command="head -c 1000 /dev/zero | tr '\\0' b")
    assert result["output"] == "b" * 1000
    assert result["truncated_bytes"] == 0


async def test_bash_does_not_see_the_parents_secrets(
    tools: Toolkit, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-parent-secret")
    monkeypatch.setenv("FLEETBUS_NATS_URL", "nats://user:pass@example:4222")
    monkeypatch.setenv("FLEETBUS_NATS_PASSWORD", "hunter2")
    output = (await _ok(tools, "Bash", command="env"))["output"]
    assert "sk-parent-secret" not in output
    assert "hunter2" not in output
    assert "FLEETBUS_NATS" not in output
    variables = dict(line.split("=", 1) for line in output.splitlines())
    assert variables["HOME"] == str(root)
    assert variables["TERM"] == "dumb"
    assert set(variables) <= {"PATH", "HOME", "LANG", "TERM", "PWD", "SHLVL", "_"}


# Read and Write


async def test_write_then_read_round_trips(tools: Toolkit, root: Path) -> None:
    text = "première ligne\nsecond line\r\nno newline at the end"
    written = await _ok(tools, "Write", file_path="deep/er/notes.txt", content=text)
    assert written == {"path": "deep/er/notes.txt", "bytes": len(text.encode())}
    assert (root / "deep" / "er" / "notes.txt").read_bytes() == text.encode()
    read = await _ok(tools, "Read", file_path="deep/er/notes.txt")
    assert read["content"] == text
    assert read["lines"] == 3
    assert read["next_offset"] is None


async def test_read_pages_with_offset_and_limit(tools: Toolkit, root: Path) -> None:
    (root / "n.txt").write_text("".join(f"{i}\n" for i in range(10)))
    page = await _ok(tools, "Read", file_path="n.txt", offset=3, limit=4)
    assert page["content"] == "3\n4\n5\n6\n"
    assert page["next_offset"] == 7
    rest = await _ok(tools, "Read", file_path="n.txt", offset=7, limit=4)
    assert rest["content"] == "7\n8\n9\n"
    assert rest["next_offset"] is None


async def test_read_stops_at_the_size_cap(root: Path) -> None:
    tools = coding_tools(FileSandbox(root, max_bytes=100))
    (root / "big.txt").write_text("x" * 29 + "\n" + "y" * 29 + "\n" + "z" * 59 + "\n")
    first = await _ok(tools, "Read", file_path="big.txt")
    assert first["lines"] == 2
    assert first["next_offset"] == 2
    assert "z" not in first["content"]
    (root / "long.txt").write_text("w" * 500)
    assert "longer than 100 bytes" in await _fails(tools, "Read", file_path="long.txt")


async def test_read_refuses_a_binary_file(tools: Toolkit, root: Path) -> None:
    (root / "b.bin").write_bytes(b"\x7fELF\x00\x01")
    assert "binary" in await _fails(tools, "Read", file_path="b.bin")


async def test_write_refuses_more_than_the_cap(root: Path) -> None:
    tools = coding_tools(FileSandbox(root, max_bytes=10))
    assert "at most 10" in await _fails(tools, "Write", file_path="a.txt", content="x" * 11)
    assert not (root / "a.txt").exists()


@pytest.mark.parametrize("name", ["Read", "Write", "Edit"])
@pytest.mark.parametrize("path", ["../outside/secret.txt", "sub/../../outside/secret.txt", "ABS"])
async def test_file_tools_refuse_paths_outside_the_root(
    tools: Toolkit, root: Path, outside: Path, name: str, path: str
) -> None:
    (root / "sub").mkdir()
    target = str(outside / "secret.txt") if path == "ABS" else path
    arguments: dict[str, Any] = {"file_path": target}
    if name == "Write":
        arguments["content"] = "overwritten"
    if name == "Edit":
        arguments |= {"old_string": "needle", "new_string": "pin"}
    assert "escapes the sandbox root" in await _fails(tools, name, **arguments)
    assert (outside / "secret.txt").read_text() == "top secret needle\n"


@pytest.mark.parametrize("name", ["Read", "Write", "Edit"])
async def test_file_tools_refuse_a_symlink_pointing_outside(
    tools: Toolkit, root: Path, outside: Path, name: str
) -> None:
    (root / "link.txt").symlink_to(outside / "secret.txt")
    (root / "dir").symlink_to(outside, target_is_directory=True)
    for path in ("link.txt", "dir/secret.txt", "dir/new.txt"):
        arguments: dict[str, Any] = {"file_path": path}
        if name == "Write":
            arguments["content"] = "overwritten"
        if name == "Edit":
            arguments |= {"old_string": "needle", "new_string": "pin"}
        assert "escapes the sandbox root" in await _fails(tools, name, **arguments)
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "top secret needle\n"


# Edit


async def test_edit_replaces_a_unique_string(tools: Toolkit, root: Path) -> None:
    (root / "a.py").write_text("x = 1\ny = 2\n")
    result = await _ok(tools, "Edit", file_path="a.py", old_string="y = 2", new_string="y = 3")
    assert result == {"path": "a.py", "replacements": 1}
    assert (root / "a.py").read_text() == "x = 1\ny = 3\n"


async def test_edit_refuses_an_ambiguous_string(tools: Toolkit, root: Path) -> None:
    (root / "a.py").write_text("n = 0\nn = 0\n")
    message = await _fails(tools, "Edit", file_path="a.py", old_string="n = 0", new_string="n = 1")
    assert "occurs 2 times" in message
    assert "replace_all" in message
    assert (root / "a.py").read_text() == "n = 0\nn = 0\n"


async def test_edit_replace_all_replaces_every_occurrence(tools: Toolkit, root: Path) -> None:
    (root / "a.py").write_text("n = 0\nn = 0\nm = 0\n")
    result = await _ok(
        tools, "Edit", file_path="a.py", old_string="n = 0", new_string="n = 1", replace_all=True
    )
    assert result["replacements"] == 2
    assert (root / "a.py").read_text() == "n = 1\nn = 1\nm = 0\n"


async def test_edit_refuses_an_absent_string(tools: Toolkit, root: Path) -> None:
    (root / "a.py").write_text("x = 1\n")
    for replace_all in (False, True):
        message = await _fails(
            tools,
            "Edit",
            file_path="a.py",
            old_string="x = 2",
            new_string="x = 3",
            replace_all=replace_all,
        )
        assert "not found" in message
    assert (root / "a.py").read_text() == "x = 1\n"


async def test_edit_refuses_an_empty_or_unchanged_string(tools: Toolkit, root: Path) -> None:
    (root / "a.py").write_text("x = 1\n")
    assert "empty" in await _fails(tools, "Edit", file_path="a.py", old_string="", new_string="y")
    same = await _fails(tools, "Edit", file_path="a.py", old_string="x", new_string="x")
    assert "the same" in same


async def test_edit_refuses_a_file_that_is_not_utf8(tools: Toolkit, root: Path) -> None:
    (root / "latin.txt").write_bytes("café\n".encode("latin-1"))
    message = await _fails(tools, "Edit", file_path="latin.txt", old_string="caf", new_string="x")
    assert "not UTF-8" in message
    assert (root / "latin.txt").read_bytes() == "café\n".encode("latin-1")


# Grep


@pytest.fixture
def tree(root: Path) -> Path:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "a.py").write_text("def alpha():\n    return 1\n")
    (root / "src" / "b.py").write_text("def beta():\n    pass\nDEF GAMMA\n")
    (root / "notes.md").write_text("def in markdown\n")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("def in git\n")
    (root / "blob.bin").write_bytes(b"def\x00binary")
    return root


async def test_grep_finds_lines_in_path_order(tools: Toolkit, tree: Path) -> None:
    result = await _ok(tools, "Grep", pattern=r"^def \w+")
    assert [(m["path"], m["line"], m["text"]) for m in result["matches"]] == [
        ("notes.md", 1, "def in markdown"),
        ("src/b.py", 1, "def beta():"),
        ("src/pkg/a.py", 1, "def alpha():"),
    ]
    assert result["truncated"] is False


async def test_grep_filters_by_glob_and_path(tools: Toolkit, tree: Path) -> None:
    by_glob = await _ok(tools, "Grep", pattern="def", glob="*.py")
    assert {m["path"] for m in by_glob["matches"]} == {"src/b.py", "src/pkg/a.py"}
    by_path = await _ok(tools, "Grep", pattern="def", path="src/pkg")
    assert [m["path"] for m in by_path["matches"]] == ["src/pkg/a.py"]
    one_file = await _ok(tools, "Grep", pattern="pass", path="src/b.py")
    assert [(m["path"], m["line"]) for m in one_file["matches"]] == [("src/b.py", 2)]


async def test_grep_ignore_case(tools: Toolkit, tree: Path) -> None:
    result = await _ok(tools, "Grep", pattern="gamma", ignore_case=True)
    assert [m["text"] for m in result["matches"]] == ["DEF GAMMA"]
    assert (await _ok(tools, "Grep", pattern="gamma"))["matches"] == []


async def test_grep_stops_at_max_results(tools: Toolkit, root: Path) -> None:
    (root / "many.txt").write_text("hit\n" * 50)
    result = await _ok(tools, "Grep", pattern="hit", max_results=7)
    assert len(result["matches"]) == 7
    assert result["truncated"] is True
    refused = await tools.get("Grep").run({"pattern": "hit", "max_results": 100_000})
    assert refused.status == "error"
    assert refused.error_detail is not None
    assert refused.error_detail.code == "invalid_parameters"


async def test_grep_refuses_an_invalid_pattern(tools: Toolkit) -> None:
    assert "invalid regular expression" in await _fails(tools, "Grep", pattern="(unclosed")


@pytest.mark.parametrize("path", ["..", "../outside", "src/../..", "ABS"])
async def test_grep_refuses_a_path_outside_the_root(
    tools: Toolkit, tree: Path, outside: Path, path: str
) -> None:
    target = str(outside) if path == "ABS" else path
    assert "escapes the sandbox root" in await _fails(tools, "Grep", pattern="needle", path=target)


async def test_grep_does_not_follow_symlinks_outside(
    tools: Toolkit, tree: Path, outside: Path
) -> None:
    (tree / "link.txt").symlink_to(outside / "secret.txt")
    (tree / "dir").symlink_to(outside, target_is_directory=True)
    (tree / "inside.txt").write_text("needle inside\n")
    result = await _ok(tools, "Grep", pattern="needle")
    assert [m["path"] for m in result["matches"]] == ["inside.txt"]
    for path in ("link.txt", "dir", "dir/secret.txt"):
        message = await _fails(tools, "Grep", pattern="needle", path=path)
        assert "escapes the sandbox root" in message


async def test_the_default_root_is_the_environment_variable_or_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    monkeypatch.setenv(coding.CODING_ROOT_ENV, str(tmp_path))
    try:
        reloaded = importlib.reload(coding)
        written = await _ok(reloaded.toolkit, "Write", file_path="x.txt", content="here")
        assert written["path"] == "x.txt"
        assert (tmp_path / "x.txt").read_text() == "here"
        monkeypatch.delenv(coding.CODING_ROOT_ENV)
        monkeypatch.chdir(tmp_path / "..")
        reloaded = importlib.reload(coding)
        found = await _ok(reloaded.toolkit, "Grep", pattern="here", path=tmp_path.name)
        assert [m["path"] for m in found["matches"]] == [f"{tmp_path.name}/x.txt"]
    finally:
        monkeypatch.undo()
        importlib.reload(coding)
