"""``fleetbus model-worker``: serve a model on the bus, holding its API key.

``--model`` (default ``FLEETBUS_MODEL``) is a model string
(:mod:`fleetbus.models.strings`): ``openai:NAME`` (or a bare name) an
OpenAI-compatible model, ``offline`` the rule-based
:class:`~fleetbus.models.OfflineModel` (no network), ``module:attr`` a
ChatModel made in Python; not ``bus:NAME``. It is served as its name
(``openai:gpt-4.1`` as ``gpt-4-1``, ``offline`` as ``offline``), so agents use
``bus:gpt-4-1``. The
``--model-*`` options (over ``FLEETBUS_MODEL_*``) set its timeout, retries,
temperature, max tokens, tool mode and endpoint. The worker exits 1 at once
when the endpoint takes no connection. Also runs on its own as
``python -m fleetbus.cli.model_worker_cmd --model offline``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fleetbus import logs
from fleetbus.cli._common import (
    connect,
    console,
    guarded,
    model_options,
    on_stop_signals,
    run,
    setup_logging,
)
from fleetbus.cli._parsers import add_model_worker_parser as add_parser
from fleetbus.errors import ConfigError
from fleetbus.models.model import ChatModel
from fleetbus.models.settings import ModelEnvironment
from fleetbus.models.strings import (
    ModelSettings,
    check_model,
    load_model_settings,
    model_from_string,
    parse_model_string,
    served_name,
)

__all__ = ["add_parser", "cmd", "main"]

_CALL_TIMEOUT = 300.0
"""Seconds one call may take on the worker, unless the model timeout says otherwise."""


def _model(args: argparse.Namespace) -> tuple[ChatModel, ModelSettings, str]:
    """The model to serve, its settings (the command line over
    ``FLEETBUS_MODEL_*``), and the name it is served as by default.

    Raises:
        ConfigError: no model named, ``bus:NAME``, or a model that cannot be configured.
    """
    text = args.model or ModelEnvironment().model
    if not text:
        raise ConfigError(
            "name the model to serve: --model openai:NAME (or offline), or set FLEETBUS_MODEL"
        )
    spec = parse_model_string(text)
    if spec.kind == "bus":
        raise ConfigError(
            f"{text} is already served on the bus; a model worker serves openai:NAME, "
            "offline or module:attr"
        )
    settings = load_model_settings(cli=model_options(args))
    where = "--model" if args.model else "FLEETBUS_MODEL"
    try:
        model = model_from_string(text, settings)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return model, settings, served_name(model.name if spec.kind == "python" else spec.name)


def cmd(args: argparse.Namespace) -> int:
    """Serve the model until SIGTERM/SIGINT, then drain and exit 0."""
    from fleetbus.models.model_worker import ModelWorker

    model, settings, default_name = _model(args)
    served = args.serve_as or default_name

    async def serve() -> int:
        await check_model(model)  # before connecting: an unreachable endpoint stops it
        bus = await connect(args.nats, args.prefix, args.worker_id)
        try:
            worker = ModelWorker(
                bus,
                model,
                name=served,
                worker_id=args.worker_id,
                concurrency=args.concurrency,
                queue=args.queue,
                queue_timeout=args.queue_timeout,
                requests_per_minute=args.rpm,
                tokens_per_minute=args.tpm,
                drain_timeout=args.drain_timeout,
                call_timeout=settings.timeout or _CALL_TIMEOUT,
            )
            logs.bind_process(worker=worker.worker_id)
            on_stop_signals(worker.stop)
            limits = "".join(
                f", {value} {unit}"
                for value, unit in ((args.rpm, "requests/min"), (args.tpm, "tokens/min"))
                if value is not None
            )
            console.print(
                f"model worker [bold]{worker.worker_id}[/] serving {model.name} as "
                f"{bus.subjects.model(served)} on {bus.connected_url} "
                f"(concurrency {args.concurrency}{limits})",
                highlight=False,
                soft_wrap=True,
            )
            await worker.run()
            console.print(
                f"model worker {worker.worker_id} drained and stopped",
                highlight=False,
                soft_wrap=True,
            )
        finally:
            await bus.close()
        return 0

    return run(serve())


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fleetbus.cli.model_worker_cmd``: the command on its own."""
    parser = argparse.ArgumentParser(
        prog="fleetbus", description="Serve a model on the bus (API key and rate limits)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def bus_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--nats", metavar="URL", help="NATS server URL(s), comma-separated")
        p.add_argument("--prefix", help="subject prefix of the fleet")
        p.add_argument("-v", "--verbose", action="count", default=0, help="more logs")

    add_parser(sub, bus_options)
    args = parser.parse_args(["model-worker", *(sys.argv[1:] if argv is None else argv)])
    setup_logging(args.verbose)
    return guarded(lambda: cmd(args))


if __name__ == "__main__":
    raise SystemExit(main())
