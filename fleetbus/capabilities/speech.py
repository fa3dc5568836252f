"""The speech capability: :class:`SpeakReply`, the layer that turns what the
model says into audio — sentence by sentence while the model streams (found
by :class:`~fleetbus.capabilities.sentences.SentenceSplitter`), or once at the end
of the reply. It is a capability (``Agent(capabilities=[SpeakReply(…)])``)
and a middleware too (``Agent(middlewares=[SpeakReply(…)])``).

Each piece of speech becomes a WAV file in a folder, goes to a player
program, or both. Synthesis runs in a task of the reply's own, beside the
reply: the model's next piece of text never waits for the audio of the last
one. The reply ends once its speech is done (or after ``timeout``), so
nothing runs on after it. A synthesizer that fails costs the sentence, not
the reply: it is logged (and given to ``on_spoken``).

The speech model is :class:`~fleetbus.models.speech.EspeakSpeech` unless
another :class:`~fleetbus.models.speech.SpeechModel` is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shlex
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fleetbus.agents import events as ev
from fleetbus.agents.middleware import Middleware, ReplyContext
from fleetbus.capabilities.sentences import SentenceSplitter
from fleetbus.errors import ConfigError
from fleetbus.models.model import ModelRequest, ModelResponse
from fleetbus.models.speech import (
    EspeakSpeech,
    SpeechError,
    SpeechModel,
    wav_seconds,
    write_audio,
)
from fleetbus.protocol import Event, FinalAnswer, TextBlock

if TYPE_CHECKING:
    from fleetbus.agents.capability import AgentView
    from fleetbus.agents.state import AgentState

__all__ = ["SpeakReply", "SpeechMode", "Utterance"]

logger = logging.getLogger(__name__)

SpeechMode = Literal["stream", "end"]
"""``stream``: each sentence as soon as the model has said it; ``end``: the
whole answer at once when the reply ends."""


@dataclass(frozen=True, slots=True)
class Utterance:
    """One piece of a reply, spoken — or not, with ``error`` saying why.

    Attributes:
        reply_id: the reply it belongs to.
        session_id: the reply's session.
        index: its place in the reply, from 1 (resumed replies go on counting).
        text: what was said.
        path: the WAV file written, when writing to a folder.
        seconds: how long the audio plays.
        error: why it could not be spoken or played.
    """

    reply_id: str
    session_id: str | None
    index: int
    text: str
    path: Path | None = None
    seconds: float | None = None
    error: str | None = None


class SpeakReply(Middleware):
    """Speaks what the model says in a reply.

    In ``stream`` mode each sentence is spoken as soon as the model's stream
    has completed it (the ``text_delta`` events), the sentences of every
    model call of the reply — what the model says before calling tools too;
    a model call that fails and is retried loses its unfinished sentence.
    In ``end`` mode the final answer's text is spoken once, as one piece,
    when the reply ends (not when it pauses for a confirmation).

    Files are named ``<folder>/<session>/<reply_id>-<NNN>.wav`` (directly in
    ``folder`` for a reply without a session), NNN counting the reply's
    pieces from 001. For a served agent (``fleetbus agent SPEC``) they are
    written on the host serving it.

    Args:
        speech: the speech model; :class:`~fleetbus.models.speech.EspeakSpeech`
            by default.
        folder: where to write one WAV file per piece.
        player: a command that plays a WAV file (``"aplay -q"``,
            ``"paplay"``, ``["play", "-q", "-t", "wav", "-"]``): it reads the
            audio on its standard input, or gets a file's path where an
            argument says ``{path}`` (``"afplay {path}"``). Pieces are played
            one after the other.
        mode: ``stream`` or ``end``.
        timeout: the longest the end of a reply waits for its speech once
            its text is complete, in seconds; what is left then is dropped
            (and logged).
        max_sentence_chars: longer sentences are cut at a space.
        on_spoken: called with each :class:`Utterance` (spoken or failed).

    Raises:
        ConfigError: neither a folder nor a player, a player program that
            is not installed, a folder that cannot be made, a bad mode or
            timeout, or no espeak-ng for the default speech model.
    """

    def __init__(
        self,
        speech: SpeechModel | None = None,
        *,
        folder: str | Path | None = None,
        player: str | Sequence[str] | None = None,
        mode: SpeechMode = "stream",
        timeout: float = 60.0,
        max_sentence_chars: int = 400,
        on_spoken: Callable[[Utterance], None] | None = None,
    ) -> None:
        if mode not in ("stream", "end"):
            raise ConfigError(f"SpeakReply: mode must be 'stream' or 'end', not {mode!r}")
        if not timeout > 0:
            raise ConfigError(f"SpeakReply: timeout must be > 0 seconds, not {timeout}")
        if folder is None and player is None:
            raise ConfigError("SpeakReply: give a folder to write WAV files to, a player, or both")
        SentenceSplitter(max_sentence_chars)  # checks the limit
        self.player = _player_command(player) if player is not None else None
        self.folder = Path(folder) if folder is not None else None
        if self.folder is not None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(
                    f"SpeakReply: cannot make the folder {self.folder}: {exc}"
                ) from exc
        self.speech: SpeechModel = speech if speech is not None else EspeakSpeech()
        self.mode: SpeechMode = mode
        self.timeout = timeout
        self.max_sentence_chars = max_sentence_chars
        self.on_spoken = on_spoken
        self._key = f"fleetbus.speech.{id(self)}"

    def middlewares(self, agent: AgentView) -> Sequence[Middleware]:
        """Itself: as a capability, it is one layer."""
        return (self,)

    def prepare_state(self, state: AgentState) -> None:
        """Nothing: speaking keeps no state."""

    async def on_reply(
        self, ctx: ReplyContext, call_next: Callable[[], Awaitable[FinalAnswer]]
    ) -> FinalAnswer:
        speaking = _Speaking(self, ctx)
        ctx.extra[self._key] = speaking
        try:
            final = await call_next()
        except BaseException:
            ctx.extra.pop(self._key, None)
            await speaking.cancel()  # interrupted or lost: its speech stops too
            raise
        ctx.extra.pop(self._key, None)
        if self.mode == "end":
            if final.finished_reason != "paused":
                speaking.say(_text_of(final))
        else:
            speaking.flush()
        await speaking.close(self.timeout)
        return final

    def on_event(self, ctx: ReplyContext, event: Event) -> None:
        if event.event != ev.TEXT_DELTA or self.mode != "stream":
            return
        speaking = ctx.extra.get(self._key)
        text = event.data.get("text")
        if isinstance(speaking, _Speaking) and isinstance(text, str):
            speaking.streamed = True
            speaking.feed(text)

    async def on_model_call(
        self,
        ctx: ReplyContext,
        request: ModelRequest,
        call_next: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse:
        speaking = ctx.extra.get(self._key)
        if not isinstance(speaking, _Speaking) or self.mode != "stream":
            return await call_next(request)
        speaking.streamed = False
        try:
            response = await call_next(request)
        except BaseException:
            speaking.splitter.discard()  # a failed attempt's half sentence
            raise
        if not speaking.streamed:  # a model that answers without streaming its text
            speaking.feed(response.text)
        speaking.flush()  # this message is complete: its last sentence too
        return response

    async def _speak(self, utterance: Utterance) -> Utterance:
        """Synthesize one piece, write it and play it; the utterance as done.

        Raises:
            SpeechError: it could not be spoken, written or played.
            ConfigError: the speech model's program is missing.
        """
        audio = await self.speech.synthesize(utterance.text)
        try:
            seconds: float | None = wav_seconds(audio)
        except SpeechError:
            seconds = None
        path = None
        if self.folder is not None:
            path = self._path(utterance)
            try:
                await asyncio.to_thread(write_audio, audio, path)
            except OSError as exc:
                raise SpeechError(f"could not write {path}: {exc}") from exc
        if self.player is not None:
            await self._play(audio, path)
        return Utterance(
            reply_id=utterance.reply_id,
            session_id=utterance.session_id,
            index=utterance.index,
            text=utterance.text,
            path=path,
            seconds=seconds,
        )

    def _first_index(self, ctx: ReplyContext) -> int:
        """The number of the reply's next piece: 1, or after the files a
        paused part of the same reply wrote."""
        if self.folder is None:
            return 1
        taken = [
            int(match.group(1))
            for file in self._directory(ctx.session_id).glob(f"{_safe(ctx.reply_id)}-*.wav")
            if (match := re.fullmatch(r".*-(\d+)\.wav", file.name))
        ]
        return max(taken, default=0) + 1

    def _directory(self, session_id: str | None) -> Path:
        assert self.folder is not None
        return self.folder / _safe(session_id) if session_id else self.folder

    def _path(self, utterance: Utterance) -> Path:
        name = f"{_safe(utterance.reply_id)}-{utterance.index:03d}.wav"
        return self._directory(utterance.session_id) / name

    async def _play(self, audio: bytes, path: Path | None) -> None:
        assert self.player is not None
        with contextlib.ExitStack() as stack:
            command = self.player
            if any("{path}" in arg for arg in command):
                if path is None:
                    temporary = stack.enter_context(tempfile.TemporaryDirectory())
                    path = write_audio(audio, Path(temporary) / "speech.wav")
                command = [arg.replace("{path}", str(path)) for arg in command]
                feed = None
            else:
                feed = audio
            await _run_player(command, feed)


async def _run_player(command: list[str], audio: bytes | None) -> None:
    """Run the player to its end (killed if the reply's speech is cancelled)."""
    try:
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE if audio is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        raise SpeechError(f"could not run the player {command[0]}: {exc}") from exc
    try:
        _, err = await process.communicate(audio)
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    if process.returncode != 0:
        detail = err.decode(errors="replace").strip()[:500] or "no message"
        raise SpeechError(
            f"the player {command[0]} exited with status {process.returncode}: {detail}"
        )


class _Speaking:
    """The speech of one reply: sentences queued as they complete, spoken in
    order by one task that the reply's ``on_reply`` starts and awaits."""

    def __init__(self, owner: SpeakReply, ctx: ReplyContext) -> None:
        self.owner = owner
        self.ctx = ctx
        self.splitter = SentenceSplitter(owner.max_sentence_chars)
        self.streamed = False
        """Whether the model call in progress has streamed text."""
        self.index = owner._first_index(ctx)
        self._first = self.index
        self._handled = 0
        self.queue: asyncio.Queue[Utterance | None] = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._run())

    def feed(self, text: str) -> None:
        for sentence in self.splitter.feed(text):
            self.say(sentence)

    def flush(self) -> None:
        for sentence in self.splitter.flush():
            self.say(sentence)

    def say(self, text: str) -> None:
        """Queue ``text`` to be spoken (nothing if it has nothing to say)."""
        text = _speakable(text)
        if not any(c.isalnum() for c in text):
            return
        ctx = self.ctx
        self.queue.put_nowait(Utterance(ctx.reply_id, ctx.session_id, self.index, text))
        self.index += 1

    async def close(self, timeout: float) -> None:
        """Wait for what is queued to be spoken, at most ``timeout`` seconds."""
        self.queue.put_nowait(None)
        try:
            done, _ = await asyncio.wait({self.task}, timeout=timeout)
        except BaseException:
            await self.cancel()
            raise
        if not done:
            left = self.index - self._first - self._handled
            logger.warning(
                "%s: the speech of reply %s took longer than %g s: %d piece(s) dropped",
                self.ctx.agent_name,
                self.ctx.reply_id,
                timeout,
                left,
                extra={"session_id": self.ctx.session_id, "call_id": self.ctx.reply_id},
            )
            await self.cancel()

    async def cancel(self) -> None:
        """Stop speaking now (a player is killed)."""
        self.task.cancel()
        await asyncio.wait({self.task})

    async def _run(self) -> None:
        while (utterance := await self.queue.get()) is not None:
            try:
                done = await self.owner._speak(utterance)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the sentence is lost, not the reply
                logger.warning(
                    "%s: could not speak piece %d of reply %s (%s): %s",
                    self.ctx.agent_name,
                    utterance.index,
                    utterance.reply_id,
                    self.owner.speech.name,
                    exc,
                    extra={"session_id": self.ctx.session_id, "call_id": self.ctx.reply_id},
                )
                done = Utterance(
                    reply_id=utterance.reply_id,
                    session_id=utterance.session_id,
                    index=utterance.index,
                    text=utterance.text,
                    error=f"{type(exc).__name__}: {exc}",
                )
            else:
                logger.debug(
                    "%s: spoke piece %d of reply %s (%s s)%s",
                    self.ctx.agent_name,
                    done.index,
                    done.reply_id,
                    f"{done.seconds:.2f}" if done.seconds is not None else "?",
                    f" to {done.path}" if done.path is not None else "",
                    extra={"session_id": self.ctx.session_id, "call_id": self.ctx.reply_id},
                )
            self._handled += 1
            if self.owner.on_spoken is not None:
                try:
                    self.owner.on_spoken(done)
                except Exception:
                    logger.exception("%s: on_spoken failed", self.ctx.agent_name)


def _player_command(player: str | Sequence[str]) -> list[str]:
    command = shlex.split(player) if isinstance(player, str) else list(player)
    if not command or not command[0]:
        raise ConfigError("SpeakReply: the player command is empty")
    if shutil.which(command[0]) is None:
        raise ConfigError(
            f"SpeakReply: the player {command[0]!r} is not installed "
            "(aplay is in Debian's alsa-utils, paplay in pulseaudio-utils)"
        )
    return command


def _text_of(final: FinalAnswer) -> str:
    if isinstance(final.content, str):
        return final.content
    return " ".join(b.text for b in final.content if isinstance(b, TextBlock))


_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_MARKUP = re.compile(r"[*_`#>|~]+")


def _speakable(text: str) -> str:
    """``text`` without the Markdown marks a synthesizer would stumble on."""
    text = _MARKUP.sub(" ", _LINK.sub(r"\1", text))
    return " ".join(text.split())


def _safe(name: str | None) -> str:
    """``name`` as one file name: letters, digits, ``._-``; others ``_``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name or "")[:100]
    return safe if safe.strip(".") else f"_{safe}"
