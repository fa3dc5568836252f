"""What ``bench/simulation.py`` needs to measure two session designs in one
run: the previous design's tree exported from git, and the bus work of each
design counted on the server.

- :func:`exported`: ``git archive <commit>`` unpacked in a temporary
  directory, its bytecode compiled (as ``make test`` compiles the work tree's:
  the start-up measured is not a compilation), removed at the end;
- :class:`Writes`: the messages stored in each stream of a fleet, from the
  streams' last sequences (appends and lease writes, as the server counts
  them: nothing is added to the path measured); and each stream's bytes,
  copies and leader (:meth:`Writes.streams`);
- :class:`ApiTap`: the JetStream API requests of each fleet (reads: direct
  gets, message gets; the rest), heard by a plain subscription on
  ``$JS.API.>``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription


@contextlib.contextmanager
def exported(root: Path, commit: str) -> Iterator[Path]:
    """The tree of ``commit`` (of the repository at ``root``), compiled, in a
    temporary directory removed on exit."""
    with tempfile.TemporaryDirectory(prefix=f"fleetbus-{commit[:7]}-") as tmp:
        archive = subprocess.run(
            ["git", "archive", commit], cwd=root, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        tree = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", str(tree / "fleetbus"), str(tree / "bench")],
            check=True,
        )
        yield tree


def _owned(name: str, bucket_prefix: str) -> str | None:
    """The short name of stream ``name`` if it belongs to the fleet whose
    bucket names start with ``bucket_prefix_`` (a KV bucket's stream too)."""
    for stem in (f"{bucket_prefix}_", f"KV_{bucket_prefix}_"):
        if name.startswith(stem):
            return name[len(stem) :]
    return None


class Writes:
    """Messages stored per stream of a fleet, between two :meth:`snapshot` s."""

    def __init__(self, nc: Client, bucket_prefix: str) -> None:
        self._js = nc.jetstream()
        self.bucket_prefix = bucket_prefix

    async def snapshot(self) -> dict[str, int]:
        """Each stream's last sequence, by short name (``session``, ``session_leases``…)."""
        last = {}
        for info in await self._js.streams_info():
            name = _owned(info.config.name or "", self.bucket_prefix)
            if name is not None:
                last[name] = info.state.last_seq
        return last

    async def streams(self) -> dict[str, dict[str, Any]]:
        """Each stream's messages and bytes stored (``state.bytes``), its
        copies, and its leader on a cluster (the node's ``server_name``)."""
        out = {}
        for info in await self._js.streams_info():
            name = _owned(info.config.name or "", self.bucket_prefix)
            if name is not None:
                out[name] = {
                    "messages": info.state.messages,
                    "bytes": info.state.bytes,
                    "replicas": info.config.num_replicas or 1,
                    "leader": info.cluster.leader if info.cluster is not None else None,
                }
        return dict(sorted(out.items()))

    @staticmethod
    def per(before: dict[str, int], after: dict[str, int], replies: int) -> dict[str, float]:
        """Messages stored per reply in each stream that took any."""
        out = {}
        for name, seq in sorted(after.items()):
            added = seq - before.get(name, 0)
            if added:
                out[name] = round(added / replies, 3)
        return out


class ApiTap:
    """JetStream API requests per fleet, by kind (``direct_get``,
    ``msg_get``, ``other``), counted as the server receives them."""

    def __init__(self, nc: Client, bucket_prefixes: list[str]) -> None:
        self._nc = nc
        self._prefixes = bucket_prefixes
        self.counts: dict[str, Counter[str]] = {p: Counter() for p in bucket_prefixes}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe("$JS.API.>", cb=self._heard)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _heard(self, msg: Msg) -> None:
        subject = msg.subject
        if subject.startswith("$JS.API.DIRECT.GET."):
            kind = "direct_get"
        elif subject.startswith("$JS.API.STREAM.MSG.GET."):
            kind = "msg_get"
        else:
            kind = "other"
        for prefix in self._prefixes:
            if f".{prefix}_" in subject or f".KV_{prefix}_" in subject:
                self.counts[prefix][kind] += 1
                return

    def snapshot(self, bucket_prefix: str) -> Counter[str]:
        return Counter(self.counts[bucket_prefix])

    @staticmethod
    def per(before: Counter[str], after: Counter[str], replies: int) -> dict[str, float]:
        return {
            k: round((after[k] - before[k]) / replies, 3)
            for k in sorted(after)
            if after[k] != before[k]
        }
