"""Log lines that carry the ids a fleet is followed by.

Every fleetbus process logs through the standard :mod:`logging` module. What
this module adds:

- **Correlation ids on every line.** The ids a log call passes in ``extra``
  (``call_id``, ``session_id``, ``agent``, ``worker``, ``tool``) are shown, and
  so are the ids bound for the work in progress with :func:`bind` (a
  :mod:`contextvars` value: a serve loop binds the agent, the session and the
  request's ``call_id`` once, and every line logged while it handles that
  message carries them, whoever logs it). The process's own identity (a
  worker id, a host's replica id) is bound with :func:`bind_process`.
- **Trace ids.** When OpenTelemetry is installed and a span is current, its
  trace and span ids are added (``trace_id``, ``span_id``).
- **Two formats.** ``text``: the message, then the ids as ``key=value``;
  ``json``: one JSON object a line (``orjson``), for log collectors.

:func:`configure` sets up the root logger for a process; the ``fleetbus``
command calls it from ``--log-format``/``FLEETBUS_LOG_FORMAT`` and
``-v``/``FLEETBUS_LOG_LEVEL``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, Literal

import orjson
from pydantic import ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleetbus.errors import ConfigError

__all__ = [
    "IDS",
    "ContextFilter",
    "JsonFormatter",
    "TextFormatter",
    "bind",
    "bind_process",
    "configure",
    "level_from_env",
    "serving",
]

LogFormat = Literal["text", "json"]

IDS = ("agent", "session_id", "call_id", "tool", "worker", "trace_id", "span_id")
"""The correlation ids a line may carry, in the order they are shown."""

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING}
_LEVELS.update(ERROR=logging.ERROR, CRITICAL=logging.CRITICAL, WARN=logging.WARNING)

_bound: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("fleetbus_log_ids")
_serving: contextvars.ContextVar[Any] = contextvars.ContextVar("fleetbus_log_message")
_process: dict[str, str] = {}


def serving(message: Any) -> None:
    """Mark the protocol message this task handles: every line it logs from now
    on carries the message's ``session_id`` and ``call_id``. One context
    variable set, for serve loops (each request runs in a task of its own,
    so nothing needs resetting)."""
    _serving.set(message)


@contextlib.contextmanager
def bind(**ids: str | None) -> Iterator[None]:
    """Carry ``ids`` (``agent=``, ``session_id=``, ``call_id=``, …) on every line
    logged in this context (this task and the tasks it starts) until the
    block ends; ``None`` values are left out."""
    merged = {**_bound.get({}), **{k: v for k, v in ids.items() if v is not None}}
    token = _bound.set(merged)
    try:
        yield
    finally:
        _bound.reset(token)


def bind_process(**ids: str | None) -> None:
    """Carry ``ids`` on every line this process logs (its worker or replica id)."""
    for key, value in ids.items():
        if value is None:
            _process.pop(key, None)
        else:
            _process[key] = value


def _trace_ids() -> dict[str, str]:
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:  # not imported by anyone: no span can be current
        return {}
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}


class ContextFilter(logging.Filter):
    """Puts the bound ids (process, context, current span) on each record,
    without overriding what the log call passed in ``extra``."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = record.__dict__
        for source in (_process, _bound.get({}), _trace_ids()):
            for key, value in source.items():
                fields.setdefault(key, value)
        message = _serving.get(None)
        if message is not None:
            for key in ("session_id", "call_id"):
                carried = getattr(message, key, None)
                if carried is not None:
                    fields.setdefault(key, carried)
        return True


def _ids(record: logging.LogRecord) -> dict[str, str]:
    fields = record.__dict__
    return {key: str(fields[key]) for key in IDS if fields.get(key) is not None}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``, the ids, and ``exception`` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **_ids(record),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class TextFormatter(logging.Formatter):
    """The message, then its ids as ``key=value``."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        ids = " ".join(f"{k}={v}" for k, v in _ids(record).items())
        return f"{text}  [{ids}]" if ids else text


class LogSettings(BaseSettings):
    """The log settings read from the environment (an empty variable is as
    if unset). The log format's variable, ``FLEETBUS_LOG_FORMAT``, is the
    ``fleetbus`` command's (:mod:`fleetbus.cli.settings`)."""

    model_config = SettingsConfigDict(
        env_prefix="FLEETBUS_", env_ignore_empty=True, extra="ignore", frozen=True
    )

    log_level: Literal["debug", "info", "warning", "warn", "error", "critical"] | None = None
    """``FLEETBUS_LOG_LEVEL``: the log level without ``-v`` (``debug``,
    ``info``, ``warning``, ``error``, ``critical``; any case); unset: warning."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() or None if isinstance(value, str) else value


def level_from_env(verbose: int = 0) -> int:
    """The log level: ``-v`` info, ``-vv`` debug; without them
    ``FLEETBUS_LOG_LEVEL`` (``debug``, ``info``, ``warning``, ``error``), else warning.

    Raises:
        ConfigError: ``FLEETBUS_LOG_LEVEL`` names no level.
    """
    if verbose > 0:
        return logging.INFO if verbose == 1 else logging.DEBUG
    try:
        name = LogSettings().log_level
    except ValidationError as exc:
        given = exc.errors()[0].get("input")
        raise ConfigError(
            f"FLEETBUS_LOG_LEVEL must be debug, info, warning or error, not {given!r}"
        ) from None
    return logging.WARNING if name is None else _LEVELS[name.upper()]


def configure(
    level: int,
    log_format: LogFormat = "text",
    *,
    handler: logging.Handler | None = None,
    text_format: str = "%(asctime)s %(levelname)s %(name)s: %(message)s",
) -> logging.Handler:
    """Send the process's logs at ``level`` and above through ``handler`` (a
    stream handler on stderr by default) in ``log_format``, each line with its
    ids; returns the handler, which replaces any earlier one installed here.

    Args:
        level: the lowest level logged.
        log_format: ``text`` or ``json``.
        handler: where lines go (the ``fleetbus`` command passes a rich
            handler for text, which adds the time and level itself).
        text_format: the ``logging`` format of a text line, before its ids.

    Raises:
        ConfigError: an unknown format.
    """
    if log_format == "json":
        formatter: logging.Formatter = JsonFormatter()
    elif log_format == "text":
        formatter = TextFormatter(text_format)
    else:
        raise ConfigError(f"the log format must be text or json, not {log_format!r}")
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    handler.addFilter(ContextFilter())
    handler.set_name("fleetbus")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "fleetbus"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler
