"""Speech: the :class:`SpeechModel` seam that turns text into audio, and
:class:`EspeakSpeech`, the default, on the ``espeak-ng`` program.

A speech model takes text and answers a WAV file's bytes; :func:`speak_to_file`
writes them to a file. :class:`~fleetbus.agents.SpeakReply` speaks an agent's
reply with one, as it streams or once at its end.

espeak-ng is a system package, not a Python one (``apt-get install espeak-ng``
on Debian and Ubuntu; ``bash scripts/ensure-espeak.sh`` in a fleetbus checkout
installs it when missing). It runs once per text, as a subprocess under a
timeout, fed the text on its standard input; it needs no network and no
model weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
import tempfile
import wave
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, Field

from fleetbus.errors import ConfigError, FleetbusError
from fleetbus.models.settings import ModelEnvironment, check_ranges

__all__ = [
    "ESPEAK_INSTALL_HINT",
    "EspeakSpeech",
    "SpeechError",
    "SpeechModel",
    "speak_to_file",
    "wav_seconds",
    "write_audio",
]

ESPEAK_INSTALL_HINT = (
    "install it with `sudo apt-get install espeak-ng` (Debian, Ubuntu) or "
    "`bash scripts/ensure-espeak.sh` in a fleetbus checkout, "
    "or set FLEETBUS_ESPEAK to the program's path"
)
"""How to get espeak-ng, as the error of a machine without it says."""

_STDERR_LIMIT = 500
"""Characters of the program's standard error kept in an error message."""


class SpeechError(FleetbusError):
    """Text could not be turned into audio: the synthesizer failed, timed
    out or answered something that is not audio."""


@runtime_checkable
class SpeechModel(Protocol):
    """Turns text into speech.

    Implementations answer a whole WAV file (RIFF header and PCM samples)
    for the text given, and may be called concurrently.
    """

    @property
    def name(self) -> str:
        """A short name for logs (``espeak-ng:en``)."""
        ...

    async def synthesize(self, text: str) -> bytes:
        """The text spoken, as the bytes of a WAV file.

        Raises:
            SpeechError: the text could not be spoken.
        """
        ...


class _EspeakLimits(BaseModel):
    speed: int = Field(ge=80, le=500)
    """Words per minute espeak-ng can speak at."""
    pitch: int = Field(ge=0, le=99)
    timeout: float = Field(gt=0)


class EspeakSpeech:
    """Speech from the ``espeak-ng`` program (a formant synthesizer: robotic
    but clear, fast, offline, many languages).

    Args:
        voice: an espeak-ng voice (``en``, ``en-us``, ``fr``, ``de+f3``…;
            ``espeak-ng --voices`` lists them).
        speed: words per minute, 80 to 500 (espeak-ng's default is 175).
        pitch: 0 to 99 (50 by default).
        timeout: the longest one text may take to synthesize, in seconds;
            past it the program is killed.
        executable: the program to run; by default ``FLEETBUS_ESPEAK``, else
            ``espeak-ng`` on ``PATH``.

    Raises:
        ConfigError: espeak-ng is not installed (the message says how to
            install it), or an option is out of range.
    """

    def __init__(
        self,
        *,
        voice: str = "en",
        speed: int = 175,
        pitch: int = 50,
        timeout: float = 30.0,
        executable: str | None = None,
    ) -> None:
        if not voice or any(c.isspace() for c in voice) or voice.startswith("-"):
            raise ConfigError(f"EspeakSpeech: voice {voice!r} is not a voice name (e.g. 'en')")
        check_ranges(_EspeakLimits, "EspeakSpeech", speed=speed, pitch=pitch, timeout=timeout)
        program = executable or ModelEnvironment().espeak or "espeak-ng"
        found = shutil.which(program)
        if found is None:
            raise ConfigError(
                f"espeak-ng is not installed (no {program!r} found): {ESPEAK_INSTALL_HINT}"
            )
        self.voice = voice
        self.speed = speed
        self.pitch = pitch
        self.timeout = timeout
        self.executable = found

    @property
    def name(self) -> str:
        """``espeak-ng:<voice>``."""
        return f"espeak-ng:{self.voice}"

    async def synthesize(self, text: str) -> bytes:
        """The text spoken, as the bytes of a WAV file (16-bit mono, 22050 Hz).

        Raises:
            SpeechError: the text is empty, the program failed (an unknown
                voice, say), did not finish within ``timeout``, or wrote no
                audio.
            ConfigError: the program is gone since this was made.
        """
        if not text.strip():
            raise SpeechError("nothing to speak: the text is empty")
        args = [
            "--stdout",
            "-b",
            "1",
            "-v",
            self.voice,
            "-s",
            str(self.speed),
            "-p",
            str(self.pitch),
        ]
        try:
            process = await asyncio.create_subprocess_exec(
                self.executable,
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except FileNotFoundError as exc:
            raise ConfigError(
                f"espeak-ng is not installed ({self.executable} is gone): {ESPEAK_INSTALL_HINT}"
            ) from exc
        except OSError as exc:
            raise SpeechError(f"could not run {self.executable}: {exc}") from exc
        try:
            async with asyncio.timeout(self.timeout):
                out, err = await process.communicate(text.encode())
        except TimeoutError as exc:
            raise SpeechError(
                f"espeak-ng did not finish within {self.timeout:g} s "
                f"({len(text)} characters; EspeakSpeech(timeout=…))"
            ) from exc
        finally:
            if process.returncode is None:  # timed out or cancelled: never leave it running
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if process.returncode != 0:
            detail = err.decode(errors="replace").strip()[:_STDERR_LIMIT] or "no message"
            raise SpeechError(f"espeak-ng exited with status {process.returncode}: {detail}")
        return _complete_wav(out)


def _complete_wav(data: bytes) -> bytes:
    """The WAV ``data`` with its sizes right.

    Writing to a pipe, espeak-ng cannot go back to fill in its header: the
    RIFF and data sizes it leaves are placeholders (about 2 GiB), which
    readers take for a file of hours. The samples are read as they are and
    written again under a true header.
    """
    try:
        with wave.open(io.BytesIO(data), "rb") as reader:
            params = reader.getparams()
            frames = reader.readframes(reader.getnframes())
    except (wave.Error, EOFError) as exc:
        raise SpeechError(f"espeak-ng wrote no WAV audio ({len(data)} bytes): {exc}") from exc
    width = params.sampwidth * params.nchannels
    frames = frames[: len(frames) - len(frames) % width]
    if not frames:
        raise SpeechError("espeak-ng wrote no audio samples")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(params.nchannels)
        writer.setsampwidth(params.sampwidth)
        writer.setframerate(params.framerate)
        writer.writeframes(frames)
    return buffer.getvalue()


def wav_seconds(data: bytes) -> float:
    """How long the WAV ``data`` plays, in seconds.

    Raises:
        SpeechError: ``data`` is not a WAV file.
    """
    try:
        with wave.open(io.BytesIO(data), "rb") as reader:
            return reader.getnframes() / reader.getframerate()
    except (wave.Error, EOFError, ZeroDivisionError) as exc:
        raise SpeechError(f"not WAV audio ({len(data)} bytes): {exc}") from exc


def write_audio(data: bytes, path: Path) -> Path:
    """Write ``data`` to ``path`` whole: to a temporary file beside it, then
    renamed, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return path


async def speak_to_file(speech: SpeechModel, text: str, path: str | Path) -> Path:
    """Speak ``text`` with ``speech`` into the WAV file ``path`` (written
    whole, its folder made if needed).

    Raises:
        SpeechError: the text could not be spoken, or the file not written.
    """
    audio = await speech.synthesize(text)
    target = Path(path)
    try:
        return await asyncio.to_thread(write_audio, audio, target)
    except OSError as exc:
        raise SpeechError(f"could not write {target}: {exc}") from exc
