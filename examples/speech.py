"""An agent speaks its reply: one WAV file per sentence while the answer
streams, then the same answer once more, whole, at the end of the reply.

The model is a scripted one (no network, no API key) streaming its answer in
small pieces, as a real model does, or ``FLEETBUS_MODEL``'s when it is set;
the speech is espeak-ng's
(``bash scripts/ensure-espeak.sh`` installs it). The files go to a folder,
and each is measured with the ``wave`` module::

    python examples/speech.py                 # into a temporary folder
    python examples/speech.py speech-out/     # into speech-out/
    python examples/speech.py --play "aplay -q"   # and out of the speakers

The same middleware on an agent served with ``fleetbus agent SPEC`` writes
the files on the host that serves it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import wave
from pathlib import Path

from fleetbus import Agent
from fleetbus.capabilities import SpeakReply, Utterance
from fleetbus.errors import ConfigError
from fleetbus.models import EspeakSpeech, default_model
from fleetbus.testing import ScriptedModel

ANSWER = (
    "The tide comes in twice a day. "
    "At Mont St. Michel it rises by up to 14.5 metres! "
    "Walkers on the sands are told to check the tables first. "
    "Is it dangerous? Only for those who do not."
)


async def speak(folder: Path, player: str | None) -> None:
    spoken: list[Utterance] = []
    speech = EspeakSpeech(voice="en", speed=170)
    for mode in ("stream", "end"):
        middleware = SpeakReply(
            speech, folder=folder / mode, player=player, mode=mode, on_spoken=spoken.append
        )
        model = default_model(otherwise=ScriptedModel([ANSWER], chunk_size=7))
        agent = Agent("guide", "You explain the sea.", model, middlewares=[middleware])
        final = await agent.reply("Tell me about tides.", session_id="tides")
        print(f"{mode}: the reply {final.finished_reason}; {len(spoken)} WAV file(s):")
        for utterance in spoken:
            if utterance.path is None:
                print(f"  piece {utterance.index} not spoken: {utterance.error}")
                continue
            with wave.open(str(utterance.path), "rb") as audio:
                seconds = audio.getnframes() / audio.getframerate()
            print(f"  {utterance.path.relative_to(folder)}  {seconds:5.2f} s  {utterance.text}")
        spoken.clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", help="where to write the WAV files")
    parser.add_argument("--play", metavar="COMMAND", help="a player reading WAV on stdin")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(args.folder or temporary)
        print(f"writing to {folder}")
        try:
            asyncio.run(speak(folder, args.play))
        except ConfigError as exc:  # no espeak-ng, no such player
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
