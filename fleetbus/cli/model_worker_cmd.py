"""``fleetbus model-worker``: serve a model on the bus, holding its API key.

``--model offline`` serves the rule-based :class:`~fleetbus.agents.OfflineModel`
(no network); any other name an OpenAI-compatible model. Until the command is
wired into ``fleetbus``, run it as
``python -m fleetbus.cli.model_worker_cmd --model offline``.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable, Sequence

from fleetbus.cli._common import connect, console, guarded, on_stop_signals, run, setup_logging
from fleetbus.errors import ConfigError
from fleetbus.models.model import ChatModel

__all__ = ["add_parser", "cmd", "main", "serve_name"]

_NOT_A_TOKEN = re.compile(r"[^A-Za-z0-9_-]")
_OPENAI_MODULE = "fleetbus.models.openai_model"


def serve_name(model: str) -> str:
    """The subject name a model is served as by default: ``gpt-4.1`` -> ``gpt-4-1``."""
    return _NOT_A_TOKEN.sub("-", model)


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    bus_options: Callable[[argparse.ArgumentParser], None],
) -> None:
    """Add the ``model-worker`` command to ``sub``."""
    p = sub.add_parser("model-worker", help="serve a model on the bus (API key and rate limits)")
    p.add_argument(
        "--model",
        required=True,
        metavar="NAME",
        help="'offline' (no network), or an OpenAI-compatible model name",
    )
    p.add_argument(
        "--serve-as",
        metavar="NAME",
        help="the name agents call it by (default: the model name, "
        "characters other than letters, digits, '_' and '-' replaced by '-')",
    )
    p.add_argument("--concurrency", type=int, default=8, help="calls run at once (default 8)")
    p.add_argument("--rpm", type=int, help="requests per minute (default: unlimited)")
    p.add_argument("--tpm", type=int, help="tokens per minute (default: unlimited)")
    p.add_argument("--worker-id", help="this worker's id (default: model-worker.<host>-<pid>)")
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish calls on stop"
    )
    bus_options(p)


def _model(name: str) -> ChatModel:
    if name == "offline":
        from fleetbus.models.offline import OfflineModel

        return OfflineModel()
    try:
        # Imported by name: the adapter is optional and may be absent.
        module = importlib.import_module(_OPENAI_MODULE)
        factory = module.OpenAIChatModel
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"the OpenAI adapter is unavailable ({exc}); only --model offline works here"
        ) from exc
    model = factory(name)
    if not isinstance(model, ChatModel):
        raise ConfigError(f"{_OPENAI_MODULE}.OpenAIChatModel is not a ChatModel")
    return model


def cmd(args: argparse.Namespace) -> int:
    """Serve the model until SIGTERM/SIGINT, then drain and exit 0."""
    from fleetbus.models.model_worker import ModelWorker

    model = _model(args.model)
    served = args.serve_as or serve_name(args.model)

    async def serve() -> int:
        bus = await connect(args.nats, args.prefix, args.worker_id)
        try:
            worker = ModelWorker(
                bus,
                model,
                name=served,
                worker_id=args.worker_id,
                concurrency=args.concurrency,
                requests_per_minute=args.rpm,
                tokens_per_minute=args.tpm,
                drain_timeout=args.drain_timeout,
            )
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
