"""What every command shares: running async code, logging, errors for people."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, TypeAlias, TypeVar

from pydantic import Field, TypeAdapter, ValidationError
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from fleetbus.bus import Bus, ConnectOptions, tune_gc
from fleetbus.cli.settings import cli_settings
from fleetbus.errors import FleetbusError
from fleetbus.logs import configure, level_from_env

# Lines are wrapped at the terminal's width, and not at all when the output
# is not a terminal (rich would wrap it at 80 columns): a pipe, a file, the
# log of a container (`docker compose logs`) get each line whole.
console = Console(soft_wrap=not sys.stdout.isatty())
err_console = Console(stderr=True, soft_wrap=not sys.stderr.isatty())

logger = logging.getLogger("fleetbus.cli")


def setup_logging(verbose: int, log_format: str | None = None) -> None:
    """Log warnings (``-v``: info, ``-vv``: debug; else ``FLEETBUS_LOG_LEVEL``)
    to stderr, as text (through rich on a terminal, plain lines elsewhere) or
    as JSON lines (``--log-format``, else ``FLEETBUS_LOG_FORMAT``), each line
    with its correlation ids.

    Raises:
        ConfigError: an unknown level or format.
    """
    level = level_from_env(verbose)
    chosen = cli_settings(log_format=log_format).log_format
    if chosen == "json":
        configure(level, "json")
    elif sys.stderr.isatty():
        handler = RichHandler(console=err_console, show_path=False, rich_tracebacks=False)
        configure(level, "text", handler=handler, text_format="%(message)s")
    else:
        # Not a terminal (a container's log, a file, a pipe): one whole line
        # a record, not wrapped and padded to a console's width.
        configure(level, "text")
    _log_settings.update(
        FLEETBUS_LOG_LEVEL=logging.getLevelName(level).lower(), FLEETBUS_LOG_FORMAT=chosen
    )
    # (stamina's line about each retry fleetbus schedules shows from -vv on:
    # fleetbus._retry filters it below the debug level.)


_log_settings: dict[str, str] = {}
"""The log level and format :func:`setup_logging` chose, as their variables."""


def child_environment() -> dict[str, str]:
    """The environment of a process this command starts (an agent replica):
    this one's, with the log level and format it was given (``-v``,
    ``--log-format``), so that the child logs as it does."""
    return {**os.environ, **_log_settings}


def run(main: Coroutine[Any, Any, int]) -> int:
    """Run a command's coroutine, with uvloop when it is installed, and the
    cycle collector tuned for serving (:func:`fleetbus.bus.tune_gc`).

    ``FLEETBUS_UVLOOP`` (:mod:`fleetbus.cli.settings`) chooses the standard
    event loop, ``FLEETBUS_GC_THRESHOLD`` (:mod:`fleetbus.bus.settings`)
    Python's collector settings.

    Raises:
        ConfigError: ``FLEETBUS_UVLOOP`` is not a boolean.
    """
    tune_gc()
    if cli_settings().uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def fail(message: str) -> int:
    """Tell a person what went wrong, in one line; the exit code 1."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return 1


def guarded(command: Callable[[], int]) -> int:
    """Run a command; a fleetbus error or Ctrl-C becomes one line and an exit code."""
    try:
        return command()
    except FleetbusError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    except BrokenPipeError:
        # The reader of our output left (`| head`): not an error of ours. What
        # is still buffered goes nowhere, so the exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # as a shell reports a command ended by SIGPIPE


Subcommands: TypeAlias = Any
"""What ``ArgumentParser.add_subparsers`` returns, to which a command adds
its parser with ``add_parser(NAME, help=…)``. Its class is private to
argparse, so it is not named here: ``Any``, and only ``add_parser`` is called
on it."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that knows its subcommands' parsers, and how deep
    it is among them (argparse itself keeps both in private attributes).

    Every parser made by :meth:`add_subparsers` (``sub.add_parser(…)``) is a
    :class:`Parser` one level deeper, listed in :attr:`subcommands`.

    Args:
        depth: 0 for the ``fleetbus`` parser, 1 for a command's, 2 for a
            subcommand's…
        *args: ``ArgumentParser``'s.
        **kwargs: ``ArgumentParser``'s.
    """

    def __init__(self, *args: Any, depth: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.depth = depth
        self.subcommands: list[Parser] = []
        """The parsers of the subcommands, in the order they were added."""

    def add_subparsers(self, **kwargs: Any) -> Subcommands:
        """``ArgumentParser.add_subparsers``, its parsers made as :class:`Parser`
        one level deeper and remembered in :attr:`subcommands`."""

        def make(**options: Any) -> Parser:
            child = Parser(depth=self.depth + 1, **options)
            self.subcommands.append(child)
            return child

        kwargs.setdefault("parser_class", make)
        return super().add_subparsers(**kwargs)


def add_connection_options(
    parser: argparse.ArgumentParser,
    *,
    nats_help: str = "NATS server URL(s), comma-separated (default: $FLEETBUS_NATS_URL "
    "or nats://127.0.0.1:4222)",
) -> None:
    """The options of every command that connects to NATS: ``--nats``,
    ``--prefix`` and ``--js-replicas`` (``args.nats``, ``args.prefix``,
    ``args.js_replicas``, each ``None`` when not given); ``nats_help`` is
    the help of ``--nats``."""
    parser.add_argument("--nats", metavar="URL", help=nats_help)
    parser.add_argument(
        "--prefix", help="subject prefix of the fleet (default: $FLEETBUS_PREFIX or fleet)"
    )
    parser.add_argument(
        "--js-replicas",
        type=count("a replica count is 1 to 5", ge=1, le=5),
        metavar="N",
        help="copies JetStream keeps of each KV bucket and object store, 1-5 (default: "
        "$FLEETBUS_JS_REPLICAS, else 3 on a NATS cluster and 1 on a single server)",
    )


def add_model_options(parser: argparse.ArgumentParser, *, fallback: bool = True) -> None:
    """The model settings options: ``--model-timeout``, ``--model-retries``,
    ``--model-temperature``, ``--model-max-tokens``, ``--model-tools``,
    ``--model-base-url`` and (with ``fallback``) ``--model-fallback``; each
    ``None`` when not given, and then the TOML spec or the
    ``FLEETBUS_MODEL_*`` variable decides (see :func:`model_options`)."""
    group = parser.add_argument_group("model settings (over TOML, over FLEETBUS_MODEL_*)")
    group.add_argument(
        "--model-timeout",
        type=float,
        metavar="SECONDS",
        help="seconds one model call may take (default 120)",
    )
    group.add_argument("--model-retries", type=int, metavar="N", help="retries of a failed call")
    group.add_argument("--model-temperature", type=float, metavar="T", help="sampling temperature")
    group.add_argument("--model-max-tokens", type=int, metavar="N", help="tokens per answer")
    group.add_argument(
        "--model-tools",
        choices=("auto", "on", "off"),
        help="how an OpenAI-compatible model calls tools: native calls (on), the text "
        "protocol (off), or native with tool calls read from the text too (auto, default)",
    )
    group.add_argument(
        "--model-base-url", metavar="URL", help="the OpenAI-compatible endpoint (OPENAI_BASE_URL)"
    )
    if fallback:
        group.add_argument(
            "--model-fallback", metavar="MODEL", help="a model string: takes over on failures"
        )


_MODEL_OPTIONS = (
    "timeout",
    "retries",
    "temperature",
    "max_tokens",
    "tools",
    "base_url",
    "fallback",
)


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The model settings given on the command line, by settings field name."""
    given = {name: getattr(args, f"model_{name}", None) for name in _MODEL_OPTIONS}
    return {name: value for name, value in given.items() if value is not None}


def model_option_args(options: dict[str, Any]) -> list[str]:
    """``options`` (from :func:`model_options`) as command-line arguments again."""
    out: list[str] = []
    for name, value in options.items():
        out += ["--model-" + name.replace("_", "-"), str(value)]
    return out


_N = TypeVar("_N", int, float)


def _argparse_type(adapter: TypeAdapter[_N], what: str) -> Callable[[str], _N]:
    """An argparse ``type`` that reads a value with ``adapter`` (its pydantic
    constraints), refusing anything else as ``"{what}, not '{text}'"``."""

    def parse(text: str) -> _N:
        try:
            return adapter.validate_python(text.strip())
        except ValidationError:
            raise argparse.ArgumentTypeError(f"{what}, not {text!r}") from None

    return parse


def count(what: str, *, ge: int = 0, le: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``ge`` (to ``le``); anything
    else is refused as ``"{what}, not '{text}'"``."""
    return _argparse_type(TypeAdapter(Annotated[int, Field(ge=ge, le=le)]), what)


def seconds(
    what: str, *, gt: float | None = None, ge: float | None = None
) -> Callable[[str], float]:
    """An argparse ``type``: a finite duration in seconds over ``gt`` (or from
    ``ge``); anything else is refused as ``"{what}, not '{text}'"``."""
    return _argparse_type(
        TypeAdapter(Annotated[float, Field(gt=gt, ge=ge, allow_inf_nan=False)]), what
    )


POSITIVE = count("a count of 1 or more", ge=1)
"""An argparse ``type``: a whole number of at least 1."""

COUNT = count("a count of 0 or more")
"""An argparse ``type``: a whole number of at least 0."""


async def connect(
    nats_url: str | None,
    prefix: str | None,
    name: str | None = None,
    *,
    js_replicas: int | None = None,
) -> Bus:
    """Connect with the command-line options, then the environment."""
    options = ConnectOptions.from_env(nats_url, prefix=prefix, name=name, js_replicas=js_replicas)
    return await Bus.connect(options=options)


def on_stop_signals(stop: Callable[[], None]) -> None:
    """Call ``stop`` on SIGTERM and SIGINT (graceful shutdown)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop)
        except (NotImplementedError, RuntimeError):  # not the main thread, or Windows
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(stop))


def is_tty() -> bool:
    """Whether stdout is a terminal."""
    return sys.stdout.isatty()
