"""A run's files: its results, summary, environment snapshots and state.

::

    OUT/
      results.jsonl         one record per agent per finished round (orjson)
      summary.json          the run and every finished round's figures
      snapshots/round-0000.json   the environment before round 1
      snapshots/round-0003.json   the environment after round 3 was applied
      state.json            where the run is: what resuming needs

A round is *finished* once ``state.json`` says so. Its records are written
and fsynced first, then its snapshot, then the state (written to a temporary
file, fsynced, renamed): a runner killed at any moment leaves the state of
the last finished round, and resuming truncates ``results.jsonl`` to the
size that state recorded, so the records of an unfinished round are dropped
and written again, never duplicated.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from fleetbus.errors import ConfigError

__all__ = ["STATE_VERSION", "RoundSummary", "RunFiles", "RunState"]

STATE_VERSION = 1
"""The version of ``state.json`` this code writes and reads."""


@dataclass(slots=True)
class RoundSummary:
    """The figures of one finished round.

    Attributes:
        round: its number, from 1.
        agents: how many agents it asked (or meant to).
        ok: answered in time, answer read.
        errors: answered with an error, or an answer that could not be read.
        late: asked, not answered by the deadline.
        missing: never asked before the deadline, or served by nobody.
        duration: seconds from its start to its end (``apply`` included).
        rate: answers (ok and errors) per second.
        metrics: what the simulation's ``apply`` returned.
        started_at: when it started (Unix time).
    """

    round: int
    agents: int
    ok: int = 0
    errors: int = 0
    late: int = 0
    missing: int = 0
    duration: float = 0.0
    rate: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    started_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """As JSON-ready data."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoundSummary:
        """Back from :meth:`to_dict`."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(slots=True)
class RunState:
    """Where a run is.

    Attributes:
        simulation: the simulation's name.
        run_id: the run's id (its agents' session is ``sim-<run_id>``).
        agents: the population's size.
        completed: the last finished round (0: none yet).
        results_bytes: the size of ``results.jsonl`` after that round.
        records: the records in it.
        rounds: the finished rounds' summaries.
        started_at: when the run started (Unix time).
        version: the file format's version.
    """

    simulation: str
    run_id: str
    agents: int
    completed: int = 0
    results_bytes: int = 0
    records: int = 0
    rounds: list[RoundSummary] = field(default_factory=list)
    started_at: float = 0.0
    version: int = STATE_VERSION

    @property
    def session_id(self) -> str:
        """The session every agent of the run converses in."""
        return f"sim-{self.run_id}"

    def to_dict(self) -> dict[str, Any]:
        """As JSON-ready data."""
        data = dataclasses.asdict(self)
        data["rounds"] = [r.to_dict() for r in self.rounds]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunState:
        """Back from :meth:`to_dict`.

        Raises:
            ConfigError: not a state this code can read.
        """
        try:
            if data.get("version") != STATE_VERSION:
                raise ConfigError(f"state version {data.get('version')!r}, not {STATE_VERSION}")
            return cls(
                simulation=str(data["simulation"]),
                run_id=str(data["run_id"]),
                agents=int(data["agents"]),
                completed=int(data["completed"]),
                results_bytes=int(data["results_bytes"]),
                records=int(data["records"]),
                rounds=[RoundSummary.from_dict(r) for r in data.get("rounds", [])],
                started_at=float(data.get("started_at", 0.0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"not a run state: {exc!r}") from exc


class RunFiles:
    """The files of a run in ``out``.

    Args:
        out: the run's directory (made when missing).
    """

    RESULTS = "results.jsonl"
    SUMMARY = "summary.json"
    STATE = "state.json"
    SNAPSHOTS = "snapshots"

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)

    @property
    def results(self) -> Path:
        """``results.jsonl``."""
        return self.out / self.RESULTS

    @property
    def summary(self) -> Path:
        """``summary.json``."""
        return self.out / self.SUMMARY

    @property
    def state(self) -> Path:
        """``state.json``."""
        return self.out / self.STATE

    def snapshot(self, round_no: int) -> Path:
        """The environment snapshot after round ``round_no`` (0: the start)."""
        return self.out / self.SNAPSHOTS / f"round-{round_no:04d}.json"

    def prepare(self) -> None:
        """Make the directories.

        Raises:
            ConfigError: they cannot be made.
        """
        try:
            (self.out / self.SNAPSHOTS).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot use {self.out}: {exc.strerror or exc}") from exc

    def load_state(self) -> RunState | None:
        """The run's state, or ``None`` when it has not started.

        Raises:
            ConfigError: the file cannot be read.
        """
        try:
            data = orjson.loads(self.state.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, orjson.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {self.state}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{self.state} is not a run state")
        try:
            return RunState.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{self.state}: {exc}") from exc

    def save_state(self, state: RunState) -> None:
        """Write the state atomically (the commit of a round)."""
        self._write_atomic(self.state, _dumps(state.to_dict(), orjson.OPT_INDENT_2))

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write ``summary.json`` atomically."""
        self._write_atomic(
            self.summary,
            _dumps(summary, orjson.OPT_INDENT_2),
        )

    def write_snapshot(self, round_no: int, values: dict[str, Any]) -> None:
        """Write the environment snapshot of round ``round_no`` atomically."""
        self._write_atomic(self.snapshot(round_no), _dumps(values, orjson.OPT_SORT_KEYS))

    def read_snapshot(self, round_no: int) -> dict[str, Any]:
        """The environment snapshot of round ``round_no``.

        Raises:
            ConfigError: it is missing or unreadable.
        """
        path = self.snapshot(round_no)
        try:
            data = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read the snapshot {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path} is not an environment snapshot")
        return data

    def truncate_results(self, size: int) -> None:
        """Cut ``results.jsonl`` to ``size`` bytes: what the last finished
        round left (made empty when missing).

        Raises:
            ConfigError: it is shorter than that (not this run's file).
        """
        path = self.results
        with path.open("ab") as f:
            length = f.seek(0, os.SEEK_END)
            if length < size:
                raise ConfigError(
                    f"{path} has {length} bytes, fewer than the {size} its state recorded"
                )
            if length > size:
                f.truncate(size)
                f.flush()
                os.fsync(f.fileno())

    def append_records(self, records: Iterable[dict[str, Any]]) -> tuple[int, int]:
        """Append records, one JSON object a line, and fsync; the file's new
        size and the number of records written."""
        count = 0
        with self.results.open("ab") as f:
            chunk: list[bytes] = []
            for record in records:
                chunk.append(_dumps(record))
                count += 1
                if len(chunk) >= 1024:
                    f.write(b"\n".join(chunk) + b"\n")
                    chunk.clear()
            if chunk:
                f.write(b"\n".join(chunk) + b"\n")
            f.flush()
            os.fsync(f.fileno())
            return f.tell(), count

    def records(self) -> Iterator[dict[str, Any]]:
        """The records in ``results.jsonl``, in order."""
        try:
            f = self.results.open("rb")
        except FileNotFoundError:
            return
        with f:
            for line in f:
                if line.strip():
                    yield orjson.loads(line)

    def _write_atomic(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)


def _dumps(data: Any, option: int = 0) -> bytes:
    """JSON of what a simulation made: numpy values and dict keys of any
    type are written; anything else orjson does not know is its ``str()``."""
    return orjson.dumps(
        data,
        default=str,
        option=option | orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY,
    )


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
