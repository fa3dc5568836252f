"""What ``bench/simulation.py`` reads of the machine: each process's CPU and
RSS (``/proc``), the RSS of the run's processes sampled while the rounds run,
a store directory's bytes on disk, and the answer rate over a round.

- :func:`cpu_seconds`, :func:`rss_kb`: one process, now;
- :class:`Memory`: the RSS of named processes, once (:meth:`Memory.now`) or
  every second while :meth:`Memory.sampling` runs: the peak of each process
  and the peak of their sum (one sample: the sum of the same moment);
- :func:`disk_bytes`: what ``du`` counts for a directory (blocks allocated);
- :class:`Rate`: answers counted by completion time in 10 ms buckets, read
  as the answers a second in each tenth of a round.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 1.0
"""Seconds between two samples of :class:`Memory`."""
BUCKET_S = 0.01
"""The resolution of :class:`Rate`."""


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def disk_bytes(path: Path) -> int:
    """The bytes allocated to the files under ``path`` (``du -s -B1``)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total


class Memory:
    """The RSS of the processes of a run, by label (``host1``, ``worker``,
    ``nats1``, ``runner``…). The total is over the labels that do not start
    with ``old_`` (the previous design's processes, when measured)."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self.peak_total = 0
        self.samples = 0

    def now(self) -> dict[str, int]:
        """Each process's RSS in KB, now (a process gone is left out)."""
        out = {}
        for label, pid in self.pids.items():
            with contextlib.suppress(OSError, RuntimeError):
                out[label] = rss_kb(pid)
        return out

    @staticmethod
    def total(kb: dict[str, int]) -> int:
        return sum(v for k, v in kb.items() if not k.startswith("old_"))

    @staticmethod
    def mb(kb: dict[str, int], total: int | None = None) -> dict[str, float]:
        """``kb`` in MB, with their ``total``: their sum unless given."""
        out = {k: round(v / 1024, 1) for k, v in kb.items()}
        out["total"] = round((Memory.total(kb) if total is None else total) / 1024, 1)
        return out

    def _sample(self) -> None:
        kb = self.now()
        for label, value in kb.items():
            self.peaks[label] = max(self.peaks.get(label, 0), value)
        self.peak_total = max(self.peak_total, self.total(kb))
        self.samples += 1

    @contextlib.asynccontextmanager
    async def sampling(self) -> AsyncIterator[None]:
        """Sample every second while the block runs (and once at each end)."""

        async def sample() -> None:
            while True:
                self._sample()
                await asyncio.sleep(SAMPLE_S)

        task = asyncio.create_task(sample())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self._sample()

    def peak_mb(self) -> dict[str, float]:
        return self.mb(self.peaks, self.peak_total)


class Rate:
    """Answers counted by the time they completed, from :meth:`start`."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.buckets: list[int] = []

    def start(self) -> None:
        self.started = time.perf_counter()
        self.buckets.clear()

    def answered(self) -> None:
        bucket = int((time.perf_counter() - self.started) / BUCKET_S)
        if bucket >= len(self.buckets):
            self.buckets.extend([0] * (bucket + 1 - len(self.buckets)))
        self.buckets[bucket] += 1

    def tenths(self, seconds: float) -> list[float]:
        """Answers a second in each tenth of the first ``seconds``."""
        counts = [0] * 10
        for i, count in enumerate(self.buckets):
            if count:
                counts[min(9, int((i + 0.5) * BUCKET_S * 10 / seconds))] += count
        return [round(c * 10 / seconds, 1) for c in counts]
