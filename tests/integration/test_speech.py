"""Speech across processes: an agent served by ``fleetbus agent SPEC`` speaks
its replies into WAV files on the host serving it, and the example runs.

:func:`speaker` is the spec the agent process serves
(``fleetbus agent tests.integration.test_speech:speaker``); its folder comes
from ``FLEETBUS_TEST_SPEECH_DIR``."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from fleetbus.agents import Agent
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.capabilities import SpeakReply
from fleetbus.protocol import FinalAnswer, UserRequest
from fleetbus.testing import ScriptedModel
from tests.helpers import running
from tests.integration.test_examples import run_example
from tests.unit.test_speech import assert_speech

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which(os.environ.get("FLEETBUS_ESPEAK") or "espeak-ng") is None,
        reason="espeak-ng is not installed (bash scripts/ensure-espeak.sh installs it)",
    ),
]

SAID = "The served agent speaks on its own host. Every sentence is a file. That makes three."


def speaker() -> Agent:
    """The agent of the process test: a scripted answer, spoken into a folder."""
    return Agent(
        "speaker",
        "",
        ScriptedModel([SAID], repeat_last=True, chunk_size=5),
        middlewares=[SpeakReply(folder=os.environ["FLEETBUS_TEST_SPEECH_DIR"])],
    )


async def ask_until_served(bus: Bus, text: str, session: str, timeout: float = 30.0) -> FinalAnswer:
    deadline = time.monotonic() + timeout
    while True:
        try:
            answer = await bus.request(
                bus.subjects.agent_inbox("speaker"),
                UserRequest(content=text, session_id=session),
                timeout=5,
                attempts=1,
            )
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
            continue
        assert isinstance(answer, FinalAnswer), answer
        return answer


async def test_a_served_agent_writes_a_wav_per_sentence_on_its_host(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    command = ["agent", "tests.integration.test_speech:speaker", "--no-remote-tools"]
    command += ["--nats", nats_server.url, "--prefix", bus.prefix]
    with running([command], env={"FLEETBUS_TEST_SPEECH_DIR": str(tmp_path)}):
        first = await ask_until_served(bus, "speak", "one")
        second = await ask_until_served(bus, "again", "two")
    for answer in (first, second):
        assert (answer.finished_reason, answer.content) == ("completed", SAID)
    # The answer comes after its speech: the files are there when it arrives.
    for session in ("one", "two"):
        files = sorted((tmp_path / session).glob("*.wav"))
        assert [re.sub(r"^[0-9a-f]+-", "", f.name) for f in files] == [
            "001.wav",
            "002.wav",
            "003.wav",
        ]
        durations = [assert_speech(f.read_bytes()) for f in files]
        assert durations[0] > durations[2]  # "… on its own host." against "That makes three."


def test_the_speech_example_writes_and_measures_its_files(tmp_path: Path) -> None:
    out = run_example("examples/speech.py", str(tmp_path))
    assert "stream: the reply completed; 5 WAV file(s):" in out
    assert "end: the reply completed; 1 WAV file(s):" in out
    assert len(list((tmp_path / "stream" / "tides").glob("*.wav"))) == 5
    [whole] = (tmp_path / "end" / "tides").glob("*.wav")
    assert_speech(whole.read_bytes(), min_seconds=5.0)
    seconds = [float(s) for s in re.findall(r"(\d+\.\d\d) s ", out)]
    assert len(seconds) == 6
    assert all(s > 0.5 for s in seconds)
