"""Speech: sentences found in streamed text, espeak-ng audio measured with the
``wave`` module, and SpeakReply speaking a reply — per sentence as it streams
or once at its end — without a failing or slow synthesizer breaking it."""

from __future__ import annotations

import array
import asyncio
import io
import logging
import math
import os
import shutil
import sys
import wave
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fleetbus.agents import Agent, AgentSettings, Middleware, Permissions, ReplyContext
from fleetbus.capabilities import SentenceSplitter, SpeakReply, Utterance
from fleetbus.errors import ConfigError
from fleetbus.models import (
    EspeakSpeech,
    ModelConfig,
    ModelError,
    ModelRequest,
    ModelResponse,
    SpeechError,
    SpeechModel,
    TextDelta,
    speak_to_file,
)
from fleetbus.models.model import ModelStreamItem
from fleetbus.protocol import Confirmation, ConfirmResult, Event, TextBlock, Usage
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool

needs_espeak = pytest.mark.skipif(
    shutil.which(os.environ.get("FLEETBUS_ESPEAK") or "espeak-ng") is None,
    reason="espeak-ng is not installed (bash scripts/ensure-espeak.sh installs it)",
)
"""The test runs espeak-ng (an OS process: marked slow too), and skips without it."""


ANSWER = (
    "Dr. Smith measured 3.5 litres of water this morning. "
    "Then the results went to the lab, e.g. to the chemists! "
    "Were they happy with it? Nobody knows yet"
)
SENTENCES = [
    "Dr. Smith measured 3.5 litres of water this morning.",
    "Then the results went to the lab, e.g. to the chemists!",
    "Were they happy with it?",
    "Nobody knows yet",
]


# -- measuring audio ---------------------------------------------------------------


def measure(data: bytes) -> tuple[float, float, float]:
    """Seconds, RMS of the 16-bit samples, and the share of 20 ms windows loud
    enough to be voice (silence and a click score near 0)."""
    with wave.open(io.BytesIO(data), "rb") as reader:
        assert reader.getsampwidth() == 2
        rate = reader.getframerate()
        raw = reader.readframes(reader.getnframes())
        seconds = reader.getnframes() / rate
    assert len(raw) == int(seconds * rate) * 2, "the header's size is not the data's"
    samples = array.array("h", raw)
    assert samples, "no samples"
    rms = math.sqrt(sum(s * s for s in samples) / len(samples))
    window = rate // 50
    chunks = [samples[i : i + window] for i in range(0, len(samples), window)]
    loud = sum(1 for c in chunks if math.sqrt(sum(s * s for s in c) / len(c)) > 300)
    return seconds, rms, loud / len(chunks)


def assert_speech(data: bytes, *, min_seconds: float = 0.4) -> float:
    seconds, rms, voiced = measure(data)
    assert seconds >= min_seconds, f"{seconds:.2f} s is too short for the text"
    assert rms > 500, f"RMS {rms:.0f}: silence, not speech"
    assert voiced > 0.3, f"only {voiced:.0%} of the audio is voiced"
    return seconds


def tone(seconds: float) -> bytes:
    """A WAV of a 440 Hz tone (the fake synthesizers' audio)."""
    rate = 8000
    samples = array.array(
        "h",
        (int(8000 * math.sin(2 * math.pi * 440 * n / rate)) for n in range(int(rate * seconds))),
    )
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(samples.tobytes())
    return buffer.getvalue()


class ToneSpeech:
    """Answers a tone per text, records the texts; fails on texts holding ``fail_on``."""

    name = "tone"

    def __init__(self, fail_on: str | None = None) -> None:
        self.fail_on = fail_on
        self.texts: list[str] = []

    async def synthesize(self, text: str) -> bytes:
        self.texts.append(text)
        if self.fail_on is not None and self.fail_on in text:
            raise SpeechError(f"cannot say {text!r}")
        return tone(0.05 * len(text))


def speaker(
    tmp_path: Path, speech: SpeechModel, **options: object
) -> tuple[SpeakReply, list[Utterance]]:
    spoken: list[Utterance] = []
    middleware = SpeakReply(speech, folder=tmp_path, on_spoken=spoken.append, **options)  # type: ignore[arg-type]
    return middleware, spoken


def wavs(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.wav"))


# -- sentences -----------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, len(ANSWER)])
def test_sentences_are_the_same_however_the_text_is_cut(size: int) -> None:
    splitter = SentenceSplitter()
    found: list[str] = []
    for start in range(0, len(ANSWER), size):
        found += splitter.feed(ANSWER[start : start + size])
    assert found == SENTENCES[:3]  # the last has no end mark: it waits
    assert splitter.flush() == SENTENCES[3:]
    assert splitter.pending == ""


def test_a_number_cut_at_its_point_waits_for_the_next_piece() -> None:
    splitter = SentenceSplitter()
    assert splitter.feed("It costs 3.") == []
    assert splitter.feed("5 euros. And") == ["It costs 3.5 euros."]
    assert splitter.feed(" more.") == []
    assert splitter.flush() == ["And more."]


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        (
            "J. R. R. Tolkien wrote it. He was British.",
            ["J. R. R. Tolkien wrote it.", "He was British."],
        ),
        ("1. Buy milk\n2. Call Mr. Jones\n\nDone.", ["1. Buy milk", "2. Call Mr. Jones", "Done."]),
        ('He said "stop." Then he left.', ['He said "stop."', "Then he left."]),
        ("Wait... what? Really?! Yes.", ["Wait... what?", "Really?!", "Yes."]),
        ("It is version 2. It works.", ["It is version 2.", "It works."]),
        (
            "See https://example.org/a.b for more. Thanks.",
            ["See https://example.org/a.b for more.", "Thanks."],
        ),
    ],
)
def test_sentence_ends(text: str, sentences: list[str]) -> None:
    splitter = SentenceSplitter()
    assert [*splitter.feed(text), *splitter.flush()] == sentences


def test_a_sentence_past_the_limit_is_cut_at_a_space() -> None:
    splitter = SentenceSplitter(max_chars=30)
    words = " ".join(f"word{i}" for i in range(20))
    pieces = [*splitter.feed(words), *splitter.flush()]
    assert " ".join(pieces) == words
    assert all(len(p) <= 30 for p in pieces)
    assert len(pieces) > 3


def test_discard_forgets_the_unfinished_sentence() -> None:
    splitter = SentenceSplitter()
    assert splitter.feed("One. Two is half") == ["One."]
    splitter.discard()
    assert splitter.flush() == []


# -- espeak-ng ----------------------------------------------------------------------


@pytest.mark.slow
@needs_espeak
async def test_espeak_speaks_real_audio_longer_for_longer_text() -> None:
    speech = EspeakSpeech()
    assert isinstance(speech, SpeechModel)
    short = assert_speech(await speech.synthesize("Hello."), min_seconds=0.2)
    long = assert_speech(await speech.synthesize("Hello. " + SENTENCES[0] + " " + SENTENCES[1]))
    assert long > 3 * short
    fast = measure(await EspeakSpeech(speed=350).synthesize(SENTENCES[0]))[0]
    slow = measure(await EspeakSpeech(speed=120).synthesize(SENTENCES[0]))[0]
    assert slow > 1.5 * fast


@pytest.mark.slow
@needs_espeak
async def test_speak_to_file_writes_a_wav(tmp_path: Path) -> None:
    path = await speak_to_file(EspeakSpeech(voice="en-us"), SENTENCES[0], tmp_path / "a" / "b.wav")
    assert_speech(path.read_bytes())
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.wav"]  # no partial file left


@pytest.mark.slow
@needs_espeak
async def test_an_unknown_voice_is_a_speech_error_with_espeaks_words() -> None:
    with pytest.raises(SpeechError, match="voice does not exist"):
        await EspeakSpeech(voice="nosuchvoice").synthesize("Hello.")
    with pytest.raises(SpeechError, match="empty"):
        await EspeakSpeech().synthesize("  ")


def test_without_espeak_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"espeak-ng is not installed.*apt-get install espeak-ng"):
        EspeakSpeech(executable="no-such-espeak-ng")
    monkeypatch.delenv("FLEETBUS_ESPEAK", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match=r"scripts/ensure-espeak\.sh"):
        SpeakReply(folder="/tmp")  # its default speech model is espeak-ng


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"voice": "en us"}, "voice"),
        ({"speed": 20}, "speed"),
        ({"pitch": 100}, "pitch"),
        ({"timeout": 0}, "timeout"),
    ],
)
def test_bad_espeak_options_are_config_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EspeakSpeech(executable=sys.executable, **options)  # type: ignore[arg-type]


def test_bad_speak_reply_options_are_config_errors(tmp_path: Path) -> None:
    speech = ToneSpeech()
    with pytest.raises(ConfigError, match="folder"):
        SpeakReply(speech)
    with pytest.raises(ConfigError, match="not installed"):
        SpeakReply(speech, player="no-such-player -q")
    with pytest.raises(ConfigError, match="mode"):
        SpeakReply(speech, folder=tmp_path, mode="later")  # type: ignore[arg-type]
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot make the folder"):
        SpeakReply(speech, folder=tmp_path / "file" / "sub")


# -- a reply spoken -----------------------------------------------------------------


@pytest.mark.slow
@needs_espeak
async def test_a_reply_gives_a_wav_of_real_speech_per_sentence(tmp_path: Path) -> None:
    middleware, spoken = speaker(tmp_path, EspeakSpeech())
    agent = Agent("talker", "", ScriptedModel([ANSWER], chunk_size=4), middlewares=[middleware])
    final = await agent.reply("tell me", session_id="s/1")
    assert (final.finished_reason, final.content) == ("completed", ANSWER)
    files = wavs(tmp_path)
    assert [u.text for u in spoken] == SENTENCES
    assert [u.path for u in spoken] == files
    assert [f.parent.name for f in files] == ["s_1"] * 4  # one folder per session
    assert [f.name.rsplit("-", 1)[1] for f in files] == ["001.wav", "002.wav", "003.wav", "004.wav"]
    durations = [assert_speech(f.read_bytes()) for f in files]
    assert durations == pytest.approx([u.seconds for u in spoken])
    assert durations[0] > durations[3]  # the long sentence against "Nobody knows yet"


@pytest.mark.slow
@needs_espeak
async def test_the_end_mode_speaks_the_answer_once(tmp_path: Path) -> None:
    middleware, spoken = speaker(tmp_path, EspeakSpeech(), mode="end")
    agent = Agent("talker", "", ScriptedModel([ANSWER], chunk_size=4), middlewares=[middleware])
    await agent.reply("tell me")
    [file] = wavs(tmp_path)
    assert [u.text for u in spoken] == [ANSWER]
    assert assert_speech(file.read_bytes(), min_seconds=5.0)


async def test_sentences_are_spoken_while_the_model_still_streams(tmp_path: Path) -> None:
    """The model holds its second sentence back until the first is spoken: a
    reply that spoke only at the end would never get there."""
    heard = asyncio.Event()

    class Waiting(ToneSpeech):
        async def synthesize(self, text: str) -> bytes:
            heard.set()
            return await super().synthesize(text)

    class Holding:
        name = "holding"

        async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
            yield TextDelta("First one is here. Sec")
            await asyncio.wait_for(heard.wait(), 5)
            yield TextDelta("ond one.")
            yield ModelResponse(
                content=[TextBlock(text="First one is here. Second one.")],
                usage=Usage(input_tokens=1, output_tokens=1),
            )

    speech = Waiting()
    middleware, _ = speaker(tmp_path, speech)
    final = await Agent("talker", "", Holding(), middlewares=[middleware]).reply("go")
    assert final.finished_reason == "completed"
    assert speech.texts == ["First one is here.", "Second one."]


async def test_a_failing_synthesizer_costs_its_sentence_not_the_reply(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    speech = ToneSpeech(fail_on="lab")
    middleware, spoken = speaker(tmp_path, speech)
    agent = Agent("talker", "", ScriptedModel([ANSWER]), middlewares=[middleware])
    with caplog.at_level(logging.WARNING, logger="fleetbus.capabilities.speech"):
        final = await agent.reply("tell me")
    assert (final.finished_reason, final.content) == ("completed", ANSWER)
    assert [u.error is None for u in spoken] == [True, False, True, True]
    assert "cannot say" in (spoken[1].error or "")
    assert len(wavs(tmp_path)) == 3
    assert "could not speak piece 2" in caplog.text


async def test_a_synthesizer_that_hangs_is_cut_at_the_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cancelled = asyncio.Event()

    class Hanging(ToneSpeech):
        async def synthesize(self, text: str) -> bytes:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            raise AssertionError("unreachable")

    middleware, spoken = speaker(tmp_path, Hanging(), timeout=0.2)
    agent = Agent("talker", "", ScriptedModel([ANSWER]), middlewares=[middleware])
    with caplog.at_level(logging.WARNING, logger="fleetbus.capabilities.speech"):
        final = await agent.reply("tell me")
    assert final.content == ANSWER
    assert cancelled.is_set()  # nothing runs on after the reply
    assert spoken == []
    assert "4 piece(s) dropped" in caplog.text


async def test_an_interrupted_reply_stops_its_speech(tmp_path: Path) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    class Hanging(ToneSpeech):
        async def synthesize(self, text: str) -> bytes:
            started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            raise AssertionError("unreachable")

    class Endless:
        name = "endless"

        async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
            yield TextDelta("One. Two")
            await asyncio.sleep(3600)
            yield ModelResponse(content=[TextBlock(text="never")])

    middleware, spoken = speaker(tmp_path, Hanging())
    agent = Agent("talker", "", Endless(), middlewares=[middleware])
    replying = asyncio.create_task(agent.reply("go"))
    await asyncio.wait_for(started.wait(), 10)
    agent.interrupt()
    final = await asyncio.wait_for(replying, 10)
    assert final.finished_reason == "interrupted"
    assert cancelled.is_set()
    assert spoken == []
    assert wavs(tmp_path) == []


async def test_a_retried_model_call_loses_its_half_sentence(tmp_path: Path) -> None:
    class Flaky:
        name = "flaky"
        calls = 0

        async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
            Flaky.calls += 1
            if Flaky.calls == 1:
                yield TextDelta("Hello. Half a sent")
                raise ModelError("connection reset")
            yield TextDelta("Hello again. All")
            yield TextDelta(" of it.")
            yield ModelResponse(content=[TextBlock(text="Hello again. All of it.")])

    speech = ToneSpeech()
    middleware, _ = speaker(tmp_path, speech)
    config = ModelConfig(max_retries=1, backoff=0)
    agent = Agent(
        "talker", "", Flaky(), middlewares=[middleware], settings=AgentSettings(model_calls=config)
    )
    final = await agent.reply("go")
    assert final.content == "Hello again. All of it."
    assert speech.texts == ["Hello.", "Hello again.", "All of it."]


async def test_a_model_that_does_not_stream_is_spoken_too(tmp_path: Path) -> None:
    class Whole:
        name = "whole"

        async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
            yield ModelResponse(content=[TextBlock(text="No deltas here. Only the end.")])

    speech = ToneSpeech()
    middleware, _ = speaker(tmp_path, speech)
    await Agent("talker", "", Whole(), middlewares=[middleware]).reply("go")
    assert speech.texts == ["No deltas here.", "Only the end."]


@tool
def write_note(text: str) -> str:
    """Write a note."""
    return "noted"


async def test_what_the_model_says_around_a_pause_is_numbered_on(tmp_path: Path) -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call(
                "write_note", {"text": "x"}, call_id="c1", text="Let me **note** it."
            ),
            "Noted. All done.",
        ]
    )
    speech = ToneSpeech()
    middleware, spoken = speaker(tmp_path, speech)
    agent = Agent(
        "talker",
        "",
        model,
        toolkit=Toolkit([write_note]),
        permissions=Permissions.from_strings(ask=["write_note"]),
        middlewares=[middleware],
    )
    assert (await agent.reply("note it")).finished_reason == "paused"
    final = await agent.reply(
        ConfirmResult(confirmations=[Confirmation(call_id="c1", confirmed=True)])
    )
    assert final.content == "Noted. All done."
    assert [(u.index, u.text) for u in spoken] == [
        (1, "Let me note it."),
        (2, "Noted."),
        (3, "All done."),
    ]
    assert len({u.reply_id for u in spoken}) == 1
    assert [p.name.rsplit("-", 1)[1] for p in wavs(tmp_path)] == ["001.wav", "002.wav", "003.wav"]


@pytest.mark.slow
async def test_a_player_gets_each_sentence_in_order(tmp_path: Path) -> None:
    log = tmp_path / "played.log"
    speech = ToneSpeech()
    piped = SpeakReply(speech, player=["sh", "-c", f"wc -c >> '{log}'"])
    agent = Agent(
        "talker", "", ScriptedModel(["One. Two two. Three three three."]), middlewares=[piped]
    )
    await agent.reply("count")
    sizes = [int(line) for line in log.read_text().split()]
    assert sizes == [len(tone(0.05 * len(t))) for t in ["One.", "Two two.", "Three three three."]]

    copies = tmp_path / "copies"
    copies.mkdir()
    by_path = SpeakReply(speech, player=f"cp {{path}} {copies}/", mode="end")
    await Agent("talker", "", ScriptedModel(["Once. At the end."]), middlewares=[by_path]).reply(
        "x"
    )
    [copy] = list(copies.iterdir())
    assert copy.read_bytes() == tone(0.05 * len("Once. At the end."))


@pytest.mark.slow
async def test_a_player_that_fails_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    middleware = SpeakReply(ToneSpeech(), player=["sh", "-c", "echo broken >&2; exit 3"])
    agent = Agent("talker", "", ScriptedModel(["Hello."]), middlewares=[middleware])
    with caplog.at_level(logging.WARNING, logger="fleetbus.capabilities.speech"):
        final = await agent.reply("x")
    assert final.finished_reason == "completed"
    assert "exited with status 3: broken" in caplog.text


async def test_a_middleware_sees_the_streamed_text_and_its_bugs_stay_its_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Watcher(Middleware):
        def __init__(self) -> None:
            self.pieces: list[str] = []

        def on_event(self, ctx: ReplyContext, event: Event) -> None:
            if event.event == "text_delta":
                self.pieces.append(event.data["text"])

    class Broken(Middleware):
        def on_event(self, ctx: ReplyContext, event: Event) -> None:
            raise RuntimeError("watcher bug")

    watcher = Watcher()
    agent = Agent(
        "a", "", ScriptedModel(["abcdefghij"], chunk_size=3), middlewares=[Broken(), watcher]
    )
    with caplog.at_level(logging.ERROR, logger="fleetbus.agents._reply_scope"):
        final = await agent.reply("x")
    assert (final.finished_reason, final.content) == ("completed", "abcdefghij")
    assert watcher.pieces == ["abc", "def", "ghi", "j"]
    assert "Broken.on_event failed" in caplog.text
