"""The argument parsers of the commands whose code is heavy to import (the
fleet commands, ``sim``, ``eval`` and ``model-worker``: agents, simulations,
evaluations, model adapters), apart from that code: ``fleetbus`` builds its
whole parser at every start, and imports a command's code only when it runs
that command.
A ``fleetbus worker`` (or ``call``, ``tools``, ``server``) process so starts
without importing the agent, the simulation toolkit or the OpenAI SDK.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

from fleetbus.bus.store import STORE_WAIT
from fleetbus.cli._common import (
    COUNT,
    POSITIVE,
    Subcommands,
    add_connection_options,
    add_model_options,
    seconds,
)

__all__ = [
    "EVAL_REPORT",
    "FLEET_COMMANDS",
    "SESSION_SUBCOMMANDS",
    "add_eval_parser",
    "add_fleet_commands",
    "add_model_worker_parser",
    "add_sim_parser",
    "fleet_command",
]

FLEET_COMMANDS = ("agent", "ask", "sessions", "confirm", "resume", "cancel", "watch")
"""The fleet commands: each ``NAME`` is run by ``fleetbus.cli.NAME_cmd.cmd``."""

SESSION_SUBCOMMANDS = ("history", "fork", "migrate")
"""The first words of ``fleetbus sessions`` that are not an agent's name."""

EVAL_REPORT = "report"
"""The first word of ``fleetbus eval report …`` (any other is a dataset)."""


def fleet_command(name: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs the fleet command ``name``, its module imported now.

    Raises:
        KeyError: ``name`` is not one of :data:`FLEET_COMMANDS`.
    """
    if name not in FLEET_COMMANDS:
        raise KeyError(name)
    command: Callable[[argparse.Namespace], int] = importlib.import_module(
        f"fleetbus.cli.{name}_cmd"
    ).cmd
    return command


def add_fleet_commands(
    sub: Subcommands, bus_options: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Add the fleet commands to the ``fleetbus`` parser."""
    p = sub.add_parser("agent", help="serve agents on the bus (module:factory or a TOML file)")
    p.add_argument(
        "spec",
        metavar="SPEC",
        help="module:factory returning Agent(s) or a population (an AgentSource), or agents.toml",
    )
    p.add_argument(
        "--replicas", type=POSITIVE, default=1, help="processes serving each agent (default 1)"
    )
    p.add_argument(
        "--group",
        help="serve with wildcard subscriptions in queue group host.GROUP, shared by every "
        "process started with this group (default for a population: its name)",
    )
    p.add_argument("--topic", action="append", default=[], help="a broadcast topic to observe")
    p.add_argument(
        "--durable-topics",
        action="store_true",
        help="keep the topics in JetStream streams, so a host that was down catches up",
    )
    p.add_argument("--lease-ttl", type=float, default=10.0, help="seconds a session lease lasts")
    p.add_argument(
        "--events",
        choices=("all", "final", "none"),
        default="all",
        help="what of each reply is published on its events subject (default all; final "
        "and none publish no event: the answer is in the session's journal)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        help="replies a process runs at once (default 16 for named agents, 64 for a group)",
    )
    p.add_argument(
        "--checkpoints",
        choices=("step", "reply"),
        default="step",
        help="write sessions ahead of every side effect (step, the default), or only when a "
        "request is taken and answered (reply: half the writes; a take-over reruns the reply)",
    )
    p.add_argument(
        "--no-remote-tools",
        action="store_true",
        help="do not add the tools served on the bus to the agents' toolkits",
    )
    p.add_argument(
        "--model",
        metavar="MODEL",
        help="the model of every agent of the spec, a model string: openai:NAME, bus:NAME, "
        "offline or module:attr (default: the spec's, else $FLEETBUS_MODEL)",
    )
    p.add_argument("--replica-id", help=argparse.SUPPRESS)
    add_model_options(p)
    bus_options(p)

    p = sub.add_parser("ask", help="ask an agent; streams the reply as it happens")
    p.add_argument("agent", metavar="AGENT")
    p.add_argument("text", metavar="TEXT")
    p.add_argument("--session", help="continue this session (default: a new one)")
    p.add_argument(
        "--user",
        metavar="USER_ID",
        help="who asks (the request's metadata user_id: a long-term memory keyed by user)",
    )
    p.add_argument("--json", action="store_true", help="print raw messages, one JSON a line")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    p.add_argument(
        "--schema",
        metavar="FILE",
        type=Path,
        help="a JSON Schema (of an object) the answer must fit; prints the structured answer",
    )
    bus_options(p)

    p = sub.add_parser(
        "sessions",
        help="list agent sessions; a session's history, a fork of it; migrate old sessions",
        usage="%(prog)s [AGENT | --agent AGENT] [--json] [options]\n"
        "       %(prog)s history AGENT SESSION [--json] [options]\n"
        "       %(prog)s fork AGENT SESSION --at N [--as NEW] [--json] [options]\n"
        "       %(prog)s migrate [--drop] [--json] [options]",
        description="Without a subcommand, list the sessions (of AGENT) with their status. "
        "history: the facts of a session's journal, oldest first. fork: a new session "
        "made of a session's first N facts (as history numbers them). migrate: carry the "
        "sessions of the layout before journals into the journal. The words history, "
        "fork and migrate come first; list the sessions of an agent so named with --agent.",
    )
    p.add_argument(
        "words",
        metavar="AGENT",
        nargs="*",
        help="the agent whose sessions to list, or a subcommand and its arguments",
    )
    p.add_argument("--agent", dest="agent_option", metavar="AGENT", help="list this agent's")
    p.add_argument("--at", type=int, metavar="N", help="fork: the last fact the fork keeps")
    p.add_argument(
        "--as", dest="new_session", metavar="NEW", help="fork: the new session's id (default: new)"
    )
    p.add_argument(
        "--drop",
        action="store_true",
        help="migrate: then remove the old buckets and the objects they referenced",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _store_wait_option(p)
    bus_options(p)
    p.set_defaults(sessions_usage=p.format_usage())

    p = sub.add_parser("confirm", help="allow or deny the tool calls a paused session waits for")
    p.add_argument("session", metavar="SESSION")
    p.add_argument("--allow", action="append", default=[], metavar="CALL_ID")
    p.add_argument("--deny", action="append", default=[], metavar="CALL_ID")
    p.add_argument("--always", action="store_true", help="also add a rule for these tools")
    p.add_argument(
        "--edit",
        nargs=2,
        action="append",
        default=[],
        metavar=("CALL_ID", "JSON"),
        help="allow the call with this input instead of the model's (a JSON object)",
    )
    p.add_argument(
        "--accept-rules",
        nargs="+",
        action="extend",
        default=[],
        metavar="RULE",
        help="allow rules the agent keeps for this and its later sessions, e.g. "
        "'write_file(path=notes/*)' (the pending calls show suggestions)",
    )
    p.add_argument("--agent", help="the agent (found from the session when omitted)")
    p.add_argument("--json", action="store_true", help="print raw messages, one JSON a line")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    _store_wait_option(p)
    bus_options(p)

    p = sub.add_parser(
        "resume", help="give a paused session the results of tool calls run outside the agent"
    )
    p.add_argument("session", metavar="SESSION")
    p.add_argument(
        "--result",
        nargs=2,
        action="append",
        default=[],
        metavar=("CALL_ID", "JSON"),
        help="the call's output, a JSON value (a text in quotes: '\"rows: 3\"')",
    )
    p.add_argument(
        "--error",
        nargs=2,
        action="append",
        default=[],
        metavar=("CALL_ID", "MESSAGE"),
        help="the call failed: the model sees MESSAGE as the tool's error",
    )
    p.add_argument("--agent", help="the agent (found from the session when omitted)")
    p.add_argument("--json", action="store_true", help="print raw messages, one JSON a line")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    _store_wait_option(p)
    bus_options(p)

    p = sub.add_parser("cancel", help="interrupt the reply running in a session")
    p.add_argument("session", metavar="SESSION")
    p.add_argument("--agent", help="the agent (found from the session when omitted)")
    p.add_argument("--reason", default="cancelled from the command line")
    _store_wait_option(p)
    bus_options(p)

    p = sub.add_parser("watch", help="live traffic on the bus, one message a line")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--session", help="only this session")
    group.add_argument("--agent", help="only this agent")
    p.add_argument("--json", action="store_true", help="print raw messages, one JSON a line")
    bus_options(p)


def _store_wait_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store-wait",
        type=float,
        default=STORE_WAIT,
        metavar="SECONDS",
        help="seconds to wait for the session store when it fails for a while (a cluster "
        f"electing a new leader after a node died; default {STORE_WAIT:g})",
    )


def add_sim_parser(
    sub: Subcommands, bus_options: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Add ``fleetbus sim …`` to the ``fleetbus`` parser."""
    p = sub.add_parser("sim", help="run a simulation: a population of agents, in rounds")
    sim = p.add_subparsers(dest="sim_command", metavar="SUBCOMMAND", required=True)

    def spec_options(q: argparse.ArgumentParser) -> None:
        q.add_argument("spec", metavar="SPEC", help="path/to/file.py:attr or module:attr")
        q.add_argument("--agents", type=COUNT, metavar="N", help="population size (if it allows)")
        q.add_argument(
            "--model",
            metavar="MODEL",
            help="the model of every agent, a model string: openai:NAME, bus:NAME, offline "
            "or module:attr (default: the spec's, else $FLEETBUS_MODEL)",
        )
        parent_options(q)

    def parent_options(q: argparse.ArgumentParser) -> None:
        # (given by `sim run` to the processes it starts: its pipe, which
        # closes when it is gone, and the directory where it records them)
        q.add_argument("--parent-pipe", action="store_true", help=argparse.SUPPRESS)
        q.add_argument("--run-logs", type=Path, help=argparse.SUPPRESS)

    q = sim.add_parser("run", help="run (or resume) a simulation; results in --out")
    spec_options(q)
    q.add_argument(
        "--out", type=Path, metavar="DIR", help="the run's directory (default: sim-<name>)"
    )
    q.add_argument("--rounds", type=COUNT, metavar="N", help="rounds in all (default: the spec's)")
    q.add_argument(
        "--deadline",
        type=seconds("a positive number of seconds", gt=0),
        metavar="SECONDS",
        help="seconds each round may take (default: the spec's)",
    )
    q.add_argument(
        "--concurrency",
        type=POSITIVE,
        default=1000,
        metavar="N",
        help="requests in flight (default 1000)",
    )
    q.add_argument(
        "--hosts",
        type=COUNT,
        default=1,
        metavar="K",
        help="host processes to start (default 1; 0: use running hosts)",
    )
    q.add_argument(
        "--tool-workers",
        type=COUNT,
        default=1,
        metavar="W",
        help="tool worker processes to start (default 1; 0: use running workers)",
    )
    q.add_argument(
        "--host-concurrency",
        type=POSITIVE,
        default=64,
        metavar="N",
        help="replies each host runs at once (default 64)",
    )
    add_model_options(q)
    add_connection_options(
        q,
        nats_help="NATS server URL(s) of a running fleet (default: the run starts its own "
        "nats-server, with JetStream in DIR/jetstream; $FLEETBUS_NATS_URL is not used)",
    )

    q = sim.add_parser("host", help="serve a simulation's agents (one host process)")
    spec_options(q)
    q.add_argument("--concurrency", type=POSITIVE, default=64, metavar="N")
    q.add_argument("--replica-id", help="this host's id (default: <name>@<host>-<pid>)")
    q.add_argument("--lease-ttl", type=float, default=10.0, help="seconds a session lease lasts")
    q.add_argument("--tool-wait", type=float, default=30.0, help="seconds to wait for the tools")
    add_model_options(q)
    bus_options(q)

    q = sim.add_parser("tools", help="serve a simulation's tools and environment tools")
    spec_options(q)
    q.add_argument("--concurrency", type=POSITIVE, default=256, metavar="N")
    q.add_argument("--worker-id", help="this worker's id")
    bus_options(q)

    q = sim.add_parser("report", help="write one HTML page of a run's charts (RUN_DIR/report.html)")
    q.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's directory (its --out)")
    q.add_argument(
        "--out",
        type=Path,
        metavar="FILE",
        help="where to write the page (default: RUN_DIR/report.html)",
    )

    q = sim.add_parser("server", help="the embedded nats-server of a run (sim run starts it)")
    q.add_argument("--state-dir", type=Path, required=True, help="JetStream storage")
    parent_options(q)


def add_eval_parser(
    sub: Subcommands, bus_options: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Add ``fleetbus eval …`` to the ``fleetbus`` parser."""
    p = sub.add_parser(
        "eval",
        help="evaluate an agent on a dataset of cases; or write the page of runs, compared",
        usage="fleetbus eval DATASET.jsonl --agent NAME [options]\n"
        "       fleetbus eval report RUN_DIR [NEW_RUN_DIR] [--out FILE]",
        description="Send each case of DATASET.jsonl to the agent --agent, grade its answers, "
        "and write the run (results.jsonl, summary.json, report.html) to --out. "
        "`fleetbus eval report RUN_DIR [NEW_RUN_DIR]` writes the page of a run, or of two "
        "runs side by side (the first the baseline).",
    )
    p.add_argument(
        "words",
        nargs="+",
        metavar="DATASET.jsonl | report RUN_DIR [NEW_RUN_DIR]",
        help="the dataset to run; or `report` and one or two run directories",
    )
    p.add_argument("--agent", metavar="NAME", help="the agent to evaluate (required to run)")
    p.add_argument(
        "--out",
        type=Path,
        metavar="PATH",
        help="running: the run's directory (default: eval-<dataset>-<agent>-<time>); "
        "report: the page's file (default: RUN_DIR/report.html, NEW_RUN_DIR/compare.html)",
    )
    p.add_argument(
        "--concurrency", type=POSITIVE, metavar="N", help="cases run at once (default 4)"
    )
    p.add_argument(
        "--timeout",
        type=seconds("a positive number of seconds", gt=0),
        metavar="SECONDS",
        help="seconds a case's reply (and a judge's) may take, unless the case says (default 120)",
    )
    p.add_argument(
        "--judge", metavar="AGENT", help="the judge agent of the judge graders that name none"
    )
    p.add_argument("--label", help="a name for the run on its page (default: its directory's)")
    p.add_argument(
        "--compare",
        type=Path,
        metavar="RUN_DIR",
        help="an earlier run of the dataset: the run's page shows both side by side",
    )
    p.add_argument(
        "--min-pass-rate",
        type=_share("a share from 0 to 1"),
        metavar="RATE",
        help="exit 0 when at least this share of the cases passes (default 1: all of them)",
    )
    bus_options(p)
    p.set_defaults(eval_usage=p.format_usage())


def _share(what: str) -> Callable[[str], float]:
    """An argparse ``type``: a number from 0 to 1; anything else is refused
    as ``"{what}, not '{text}'"``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not 0.0 <= value <= 1.0:
            raise argparse.ArgumentTypeError(f"{what}, not {text!r}")
        return value

    return parse


def add_model_worker_parser(
    sub: Subcommands, bus_options: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Add the ``model-worker`` command to ``sub``."""
    p = sub.add_parser("model-worker", help="serve a model on the bus (API key and rate limits)")
    p.add_argument(
        "--model",
        metavar="MODEL",
        help="a model string: openai:NAME (an OpenAI-compatible endpoint), offline (no "
        "network) or module:attr (default: $FLEETBUS_MODEL)",
    )
    p.add_argument(
        "--serve-as",
        metavar="NAME",
        help="the name agents call it by (default: the model name, "
        "characters other than letters, digits, '_' and '-' replaced by '-')",
    )
    p.add_argument("--concurrency", type=int, default=8, help="calls run at once (default 8)")
    p.add_argument(
        "--queue",
        type=int,
        metavar="N",
        help="calls that may wait for a place; more are refused with overloaded "
        "(default: as many as --concurrency)",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a call waits for a place before it is refused (default 30)",
    )
    p.add_argument("--rpm", type=int, help="requests per minute (default: unlimited)")
    p.add_argument("--tpm", type=int, help="tokens per minute (default: unlimited)")
    p.add_argument("--worker-id", help="this worker's id (default: model-worker.<host>-<pid>)")
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish calls on stop"
    )
    add_model_options(p, fallback=False)
    bus_options(p)
