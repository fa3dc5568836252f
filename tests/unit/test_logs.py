"""Log lines with their correlation ids, as text and as JSON lines."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from fleetbus.errors import ConfigError
from fleetbus.logs import bind, bind_process, configure, level_from_env


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    stream = io.StringIO()
    yield stream
    for handler in [h for h in root.handlers if h.get_name() == "fleetbus"]:
        root.removeHandler(handler)
    root.handlers[:] = before[0]
    root.setLevel(before[1])
    bind_process(worker=None)


def lines(stream: io.StringIO) -> list[dict[str, str]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_the_ids_of_extra_context_and_process(captured: io.StringIO) -> None:
    configure(logging.INFO, "json", handler=logging.StreamHandler(captured))
    log = logging.getLogger("fleetbus.test")
    bind_process(worker="worker.host-1")
    log.info("plain")
    with bind(agent="planner", session_id="s-1"):
        log.warning("taken %s", "over", extra={"call_id": "r-7"})
        with bind(call_id="r-8", tool=None):
            log.info("inner")
    log.debug("not shown at info")
    first, second, third = lines(captured)
    assert first["message"] == "plain"
    assert first["worker"] == "worker.host-1"
    assert "agent" not in first
    assert (second["level"], second["logger"], second["message"]) == (
        "warning",
        "fleetbus.test",
        "taken over",
    )
    assert (second["agent"], second["session_id"], second["call_id"]) == ("planner", "s-1", "r-7")
    assert (third["call_id"], third["agent"]) == ("r-8", "planner")
    assert "tool" not in third
    assert first["time"].endswith("+00:00")


async def test_ids_bound_in_a_task_stay_with_that_task(captured: io.StringIO) -> None:
    configure(logging.INFO, "json", handler=logging.StreamHandler(captured))
    log = logging.getLogger("fleetbus.test")

    async def serve(session: str) -> None:
        with bind(session_id=session):
            await asyncio.sleep(0.01)
            log.info("answered")

    await asyncio.gather(serve("a"), serve("b"))
    assert sorted(line["session_id"] for line in lines(captured)) == ["a", "b"]


def test_text_lines_end_with_their_ids_and_exceptions_are_kept(captured: io.StringIO) -> None:
    configure(
        logging.INFO, "text", handler=logging.StreamHandler(captured), text_format="%(message)s"
    )
    log = logging.getLogger("fleetbus.test")
    with bind(session_id="s-2"):
        log.info("hello", extra={"call_id": "c-1"})
    assert captured.getvalue().splitlines()[0] == "hello  [session_id=s-2 call_id=c-1]"
    configure(logging.INFO, "json", handler=logging.StreamHandler(captured))
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    assert "ValueError: boom" in json.loads(captured.getvalue().splitlines()[-1])["exception"]


def test_the_level_comes_from_v_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEETBUS_LOG_LEVEL", raising=False)
    assert level_from_env(0) == logging.WARNING
    assert level_from_env(1) == logging.INFO
    assert level_from_env(2) == logging.DEBUG
    monkeypatch.setenv("FLEETBUS_LOG_LEVEL", "debug")
    assert level_from_env(0) == logging.DEBUG
    assert level_from_env(1) == logging.INFO  # -v wins
    monkeypatch.setenv("FLEETBUS_LOG_LEVEL", "loud")
    with pytest.raises(ConfigError, match="FLEETBUS_LOG_LEVEL must be"):
        level_from_env(0)


def test_an_unknown_format_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="text or json"):
        configure(logging.INFO, "yaml")  # type: ignore[arg-type]


def test_a_line_logged_in_a_span_carries_its_trace(captured: io.StringIO, spans: object) -> None:
    from fleetbus import tracing

    configure(logging.INFO, "json", handler=logging.StreamHandler(captured))
    log = logging.getLogger("fleetbus.test")
    with tracing.span("fleetbus reply") as span:
        assert span is not None
        log.info("in the span")
        with tracing.span("fleetbus step") as step:
            assert step is not None
            log.info("in the step")
    log.info("after")
    in_span, in_step, after = lines(captured)
    context, inner = span.get_span_context(), step.get_span_context()
    assert (in_span["trace_id"], in_span["span_id"]) == (
        f"{context.trace_id:032x}",
        f"{context.span_id:016x}",
    )
    assert in_step["trace_id"] == in_span["trace_id"]
    assert in_step["span_id"] == f"{inner.span_id:016x}"
    assert "trace_id" not in after
    assert "span_id" not in after
