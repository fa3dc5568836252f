"""``fleetbus gateway`` under cProfile for a window of its life, for
``bench/gateway.py`` (``BENCH_PROFILE=DIR``).

Runs ``fleetbus ARGS`` in this process; SIGUSR1 starts the profiler, SIGUSR2
stops it and writes its statistics to ``PROFILE_FILE`` (``pstats`` format,
written whole under another name, then renamed), so the profile holds the
requests measured and not the start-up.

Usage: ``PROFILE_FILE=FILE python bench/_gateway_profiled.py gateway ...``
"""

from __future__ import annotations

import cProfile
import os
import signal
import sys
from types import FrameType

from fleetbus.cli import main

profiler = cProfile.Profile()


def start(_signum: int, _frame: FrameType | None) -> None:
    profiler.enable()


def stop(_signum: int, _frame: FrameType | None) -> None:
    profiler.disable()
    target = os.environ["PROFILE_FILE"]
    profiler.dump_stats(target + ".part")
    os.replace(target + ".part", target)


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    raise SystemExit(main(sys.argv[1:]))
