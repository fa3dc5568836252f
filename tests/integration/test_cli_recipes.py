"""The README's recipes run with the installed ``fleetbus`` script, as a user
types them: from the folder that holds their module, piped into ``head``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fleetbus.bus import Bus, EmbeddedServer
from tests.helpers import stop, wait_for_workers

SCRIPT = Path(sys.executable).parent / "fleetbus"

pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="the fleetbus script is not installed")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # as a user's shell: no path to the folder
    return env


async def test_the_worker_imports_a_module_of_the_working_folder(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    (tmp_path / "mytools.py").write_text(
        textwrap.dedent(
            '''
            from fleetbus import tool

            @tool
            def shout(text: str) -> str:
                """Say it louder.

                Args:
                    text: what to say.
                """
                return text.upper()
            '''
        )
    )
    proc = subprocess.Popen(  # noqa: ASYNC220 - started, not waited on
        [str(SCRIPT), "worker", "mytools", "--nats", nats_server.url, "--prefix", bus.prefix],
        cwd=tmp_path,
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        await wait_for_workers(bus, "shout", 1)
    finally:
        stop(proc)


async def test_a_closed_pipe_ends_the_output_quietly(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    from fleetbus.agents import AgentState
    from fleetbus.agents.serving.sessions import SessionStore

    store = await SessionStore.open(bus, owner="test")
    for n in range(500):  # past the pipe's buffer (64 KiB): the reader leaves first
        lease = await store.acquire("talker", f"s{n}", fresh=AgentState(agent_name="talker"))
        await store.save(lease, status="idle", release=True)
    on_bus = f"--nats {nats_server.url} --prefix {bus.prefix}"
    command = f"{SCRIPT} sessions --json {on_bus} | head -c 100"
    done = await asyncio.to_thread(
        subprocess.run,
        ["bash", "-o", "pipefail", "-c", command],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        timeout=60,
    )
    assert b"Traceback" not in done.stderr, done.stderr.decode()
    assert b"BrokenPipe" not in done.stderr, done.stderr.decode()
    assert len(done.stdout) == 100
