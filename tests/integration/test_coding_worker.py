"""The coding tools served by a real ``fleetbus worker fleetbus.tools_workers.coding``
process: rooted at ``FLEETBUS_CODING_ROOT``, and its Bash does not see the
worker's secrets."""

from __future__ import annotations

from pathlib import Path

from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from tests.helpers import wait_for_workers, workers

SPEC = "fleetbus.tools_workers.coding"


async def test_a_worker_process_serves_the_coding_tools_in_its_root(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret.txt").write_text("outside\n")
    env = {"FLEETBUS_CODING_ROOT": str(root), "OPENAI_API_KEY": "sk-worker-secret"}
    with workers(nats_server.url, bus.prefix, 1, spec=SPEC, env=env):
        await wait_for_workers(bus, "Bash", 1)
        client = ToolClient(bus, timeout=20)
        tools = await client.discover()
        written = await client.call(
            "Write", {"file_path": "pkg/mod.py", "content": "x = 1\nx = 1\n"}
        )
        ambiguous = await client.call(
            "Edit", {"file_path": "pkg/mod.py", "old_string": "x = 1", "new_string": "x = 2"}
        )
        edited = await client.call(
            "Edit",
            {
                "file_path": "pkg/mod.py",
                "old_string": "x = 1",
                "new_string": "x = 2",
                "replace_all": True,
            },
        )
        read = await client.call("Read", {"file_path": "pkg/mod.py"})
        found = await client.call("Grep", {"pattern": "x = 2", "glob": "*.py"})
        shell = await client.call("Bash", {"command": "pwd; env", "cwd": "pkg"})
        escape = await client.call("Read", {"file_path": "../secret.txt"})
    assert {"Bash", "Read", "Write", "Edit", "Grep"} <= set(tools)
    assert written.ok
    assert (root / "pkg" / "mod.py").read_text() == "x = 2\nx = 2\n"
    assert ambiguous.status == "error"
    assert ambiguous.error_detail is not None
    assert "occurs 2 times" in ambiguous.error_detail.message
    assert edited.ok
    assert isinstance(edited.content, dict)
    assert edited.content["replacements"] == 2
    assert isinstance(read.content, dict)
    assert read.content["content"] == "x = 2\nx = 2\n"
    assert isinstance(found.content, dict)
    assert [(m["path"], m["line"]) for m in found.content["matches"]] == [
        ("pkg/mod.py", 1),
        ("pkg/mod.py", 2),
    ]
    assert isinstance(shell.content, dict)
    assert shell.content["exit_code"] == 0
    output = shell.content["output"]
    assert output.startswith(f"{root / 'pkg'}\n")
    assert f"HOME={root}\n" in output
    assert "sk-worker-secret" not in output
    assert "FLEETBUS_CODING_ROOT" not in output
    assert escape.status == "error"
    assert escape.error_detail is not None
    assert "escapes the sandbox root" in escape.error_detail.message
