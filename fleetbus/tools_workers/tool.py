"""Tools as typed Python functions.

``@tool`` turns a function (sync or async) into a :class:`Tool`: its name,
its description from the docstring, the JSON Schema of its parameters from
the type hints (pydantic), and validation of the parameters it is called with::

    @tool
    def add(a: int, b: int = 1) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first addend.
            b: the second addend.
        \"\"\"
        return a + b

Running a tool never raises for what the tool does: :meth:`Tool.run` returns a
``tool_result`` message (:class:`~fleetbus.protocol.ToolResult`) whose
``status`` says how it ended, the message a worker serving the tool would
answer, but sent by nobody: its ``sender`` is empty. Toolkits are in
:mod:`fleetbus.tools_workers.toolkit`.

A generator function (sync or async) is a *streaming* tool: each chunk it
yields is handed, as it comes, to the ``on_chunk`` of :meth:`Tool.run` (an
agent streams it as a ``tool_result_delta`` event, a worker sends it as a
``tool_result`` delta), and the result is the whole: the chunks joined when
all are strings, else their list::

    @tool
    async def tail(path: str) -> AsyncIterator[str]:
        \"\"\"Lines of a log, as they are read.\"\"\"
        async for line in read_lines(path):
            yield line
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, overload

import docstring_parser
import pydantic
import pydantic_core

from fleetbus.bus.subjects import check_name
from fleetbus.errors import InvalidSubjectError, ToolDefinitionError
from fleetbus.protocol import ErrorCode, ErrorDetail, ToolResult, ToolSpec, ToolStatus
from fleetbus.protocol.codec import clip
from fleetbus.tools_workers.settings import check_ranges

__all__ = ["DEFAULT_GROUP", "Tool", "tool", "tool_failure"]

logger = logging.getLogger(__name__)

DEFAULT_GROUP = "default"
"""The group a tool joins when none is named."""

_JSON_SCALARS = frozenset({str, int, float, bool})
"""Results that are JSON as they are (exactly these types: not a subclass,
such as an enum, which pydantic turns into its value)."""


class _Limits(pydantic.BaseModel):
    timeout: float | None = pydantic.Field(gt=0)


def tool_failure(
    tool_name: str,
    status: ToolStatus,
    code: ErrorCode,
    message: str,
    *,
    call_id: str | None = None,
    session_id: str | None = None,
    sender: str = "",
) -> ToolResult:
    """A ``tool_result`` that is not a success: ``status``, and an
    ``error_detail`` of ``code`` and ``message`` (cut to ``MAX_ECHO_CHARS``:
    it may quote what the call sent).

    Args:
        tool_name: the tool called.
        status: error, timeout, denied or cancelled.
        code: the error code that goes with ``status``.
        message: a sentence for a person or a model to read.
        call_id: the call's id, when it has one.
        session_id: the session the call belongs to, if any.
        sender: who answers (a worker's id); empty for a run nobody sends.
    """
    return ToolResult(
        sender=sender,
        session_id=session_id,
        call_id=call_id,
        tool_name=tool_name,
        status=status,
        error_detail=ErrorDetail(code=code, message=clip(message)),
    )


class Tool:
    """A function that agents can call, with its schema.

    Make one with :func:`tool`. Calling the ``Tool`` object calls the function
    directly, so a decorated function is still an ordinary function.

    Attributes:
        name: the tool's name (a subject token: letters, digits, ``_``, ``-``).
        description: what it does, for the model.
        parameters: JSON Schema of its arguments object.
        timeout: seconds it may run by default (``None``: the worker's default).
        concurrency_safe: whether several calls may run at once in one agent.
        external: the agent offers the tool to the model but does not run it:
            the reply pauses until the result comes from outside
            (``external_result``).
        group: the toolkit group it joins by default.
        streams: the function is a generator: it yields its result in chunks.
        blocking: a sync function runs in a worker thread (``True``, the
            default: it may block), or on the event loop (``False``: for a
            function that only computes, briefly; it cannot be stopped, and
            while it runs nothing else of the process does).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = None,
        concurrency_safe: bool = True,
        external: bool = False,
        group: str = DEFAULT_GROUP,
        blocking: bool = True,
    ) -> None:
        if not callable(fn):
            raise ToolDefinitionError(f"a tool must wrap a function, not {fn!r}")
        self.fn = fn
        self.name: str = name or str(getattr(fn, "__name__", ""))
        try:
            check_name(self.name, what="tool name")
        except InvalidSubjectError as exc:
            raise ToolDefinitionError(str(exc)) from exc
        doc = docstring_parser.parse(inspect.getdoc(fn) or "")
        summary = "\n\n".join(p for p in (doc.short_description, doc.long_description) if p)
        self.description = description if description is not None else summary
        check_ranges(_Limits, f"tool {self.name}", ToolDefinitionError, timeout=timeout)
        self.timeout = timeout
        self.concurrency_safe = concurrency_safe
        self.external = external
        self.group = group
        self.blocking = blocking
        self.is_async = inspect.iscoroutinefunction(fn)
        self.streams = inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn)
        self._model = _parameters_model(
            fn, self.name, {p.arg_name: p.description for p in doc.params}
        )
        schema = self._model.model_json_schema()
        schema.pop("title", None)
        self.parameters: dict[str, Any] = schema
        self.__doc__ = fn.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    def spec(self) -> ToolSpec:
        """The tool as offered to a model (the same object while its name,
        description and parameters are)."""
        made = self.__dict__.get("_spec")
        if (
            made is None
            or made.name is not self.name
            or made.description is not self.description
            or made.parameters is not self.parameters
        ):
            made = self.__dict__["_spec"] = ToolSpec(
                name=self.name, description=self.description, parameters=self.parameters
            )
        return made

    def validate(self, parameters: Any) -> dict[str, Any]:
        """Validate and coerce ``parameters`` to the keyword arguments of the function.

        Raises:
            pydantic.ValidationError: they do not fit the schema.
        """
        # What model_validate does, without its wrapper, which is a large part
        # of the cost of a small call.
        model = self._model.__pydantic_validator__.validate_python(parameters)
        return dict(model.__dict__)

    async def run(
        self,
        parameters: Any,
        *,
        timeout: float | None = None,
        call_id: str | None = None,
        session_id: str | None = None,
        on_chunk: Callable[[Any], Awaitable[None]] | None = None,
    ) -> ToolResult:
        """Validate the parameters, run the function, and say how it ended.

        The result is the ``tool_result`` a worker serving the tool would
        answer, but sent by nobody: ``sender`` is empty, ``tool_name`` is
        this tool's, ``call_id`` and ``session_id`` are the ones given
        (``None`` when not: a local function does not need them).

        A sync function runs in a worker thread (on the event loop when not
        :attr:`blocking`: then it runs to its end, whatever the timeout); on
        timeout its result is abandoned (a thread cannot be stopped), an
        async one is cancelled.
        A streaming tool (:attr:`streams`) hands each chunk, made JSON, to
        ``on_chunk`` as it comes (awaited before the next is asked for), and
        ends with the whole result.
        Never raises, except ``CancelledError`` when the caller is cancelled.
        """
        name = self.name
        try:
            kwargs = self.validate(parameters)
        except pydantic.ValidationError as exc:
            return tool_failure(
                name,
                "error",
                "invalid_parameters",
                f"invalid parameters for {name}: {_brief(exc)}",
                call_id=call_id,
                session_id=session_id,
            )
        limit = self.timeout if timeout is None else timeout
        try:
            if self.streams:
                result = await self._stream(kwargs, limit, on_chunk)
            else:
                result = await self._call(kwargs, limit)
        except _DeadlineError:
            return tool_failure(
                name,
                "timeout",
                "timeout",
                f"{name} did not finish within {limit:g}s",
                call_id=call_id,
                session_id=session_id,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failed = clip(f"{type(exc).__name__}: {exc}")
            logger.info("tool %s raised %s", name, failed)
            return tool_failure(
                name, "error", "tool_error", failed, call_id=call_id, session_id=session_id
            )
        if result is None or type(result) in _JSON_SCALARS:
            content = result
        else:
            try:
                content = pydantic_core.to_jsonable_python(result)
            except ValueError as exc:  # PydanticSerializationError, or a value nested too deep
                return tool_failure(
                    name,
                    "error",
                    "tool_error",
                    f"{name} returned a {type(result).__name__}, "
                    f"which is not JSON-serializable: {exc}",
                    call_id=call_id,
                    session_id=session_id,
                )
        return ToolResult(
            session_id=session_id,
            call_id=call_id,
            tool_name=name,
            status="success",
            content=content,
        )

    async def _stream(
        self,
        kwargs: dict[str, Any],
        limit: float | None,
        on_chunk: Callable[[Any], Awaitable[None]] | None,
    ) -> Any:
        """Run a generator function to its end within ``limit`` seconds
        (:class:`_DeadlineError` after), each chunk to ``on_chunk``; the
        chunks joined when all are strings, else their list."""
        chunks: list[Any] = []

        async def take(chunk: Any) -> None:
            if chunk is not None and type(chunk) not in _JSON_SCALARS:
                chunk = pydantic_core.to_jsonable_python(chunk)
            chunks.append(chunk)
            if on_chunk is not None:
                await on_chunk(chunk)

        async def drain() -> None:
            made = self.fn(**kwargs)
            if inspect.isasyncgen(made):
                try:
                    async for chunk in made:
                        await take(chunk)
                finally:
                    await made.aclose()
                return
            end = object()
            try:
                # Each step in a thread, as a sync tool runs: it may block.
                while (
                    chunk := await asyncio.to_thread(next, made, end)
                    if self.blocking
                    else next(made, end)
                ) is not end:
                    await take(chunk)
            finally:
                with contextlib.suppress(ValueError):  # a step still running in its thread
                    made.close()

        if limit is None:
            await drain()
        else:
            deadline = asyncio.timeout(limit)
            try:
                async with deadline:
                    await drain()
            except TimeoutError as exc:
                if deadline.expired():
                    raise _DeadlineError from exc
                raise
        if all(isinstance(c, str) for c in chunks):
            return "".join(chunks)
        return chunks

    async def _call(self, kwargs: dict[str, Any], limit: float | None) -> Any:
        """Call the function; :class:`_DeadlineError` after ``limit`` seconds
        (a ``TimeoutError`` the function raises itself is its own failure).

        Does what ``asyncio.timeout`` does with one timer handle and no
        context-manager state, and arms that timer only once the function
        suspends: one that returns from its first step was never going to be
        interrupted by a timer. A timer armed and cancelled on every call is
        a noticeable part of what a worker spends on a small call, and the
        cancelled timers pile up in the loop's heap; driving the function
        through :func:`_resume` costs far less per suspension
        (``bench/tool_calls.py`` measures a worker's calls).
        """
        if not self.is_async and not self.blocking:
            # On the loop: a thread's hand-over cost a worker three times a
            # small function's own work (the calculator's).
            return self.fn(**kwargs)
        call = self.fn(**kwargs) if self.is_async else asyncio.to_thread(self.fn, **kwargs)
        if limit is None:
            return await call
        if type(call) is not types.CoroutineType:  # pragma: no cover - a coroutine function's
            try:
                async with asyncio.timeout(limit):
                    return await call
            except TimeoutError as exc:
                raise _DeadlineError from exc
        started = time.monotonic()
        try:
            suspended_on = call.send(None)  # the first step, as ``await`` takes it
        except StopIteration as returned:
            return returned.value
        # Only now the loop (asyncio.get_running_loop() makes a getpid system
        # call, Python 3.11); the deadline still counts from the start.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit - (time.monotonic() - started)
        task = asyncio.current_task(loop)
        assert task is not None  # always inside a task under asyncio
        cancelling = task.cancelling()
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = loop.call_at(deadline, expire)
        try:
            return await _resume(call, suspended_on)
        except asyncio.CancelledError:
            if expired:
                expired = False
                # Ours, unless someone else cancelled the task too.
                if task.uncancel() <= cancelling:
                    raise _DeadlineError from None
            raise
        finally:
            timer.cancel()
            if expired:  # the function swallowed our cancellation
                task.uncancel()


@types.coroutine
def _resume(call: Coroutine[Any, Any, Any], suspended_on: Any) -> Generator[Any, Any, Any]:
    """Await ``call`` from where its first step left it (suspended on
    ``suspended_on``): what ``await call`` does after that step."""
    while True:
        try:
            sent = yield suspended_on
        except GeneratorExit:
            call.close()
            raise
        except BaseException as exc:  # the task's cancellation, thrown into the call
            try:
                suspended_on = call.throw(exc)
            except StopIteration as returned:
                return returned.value
        else:
            try:
                suspended_on = call.send(sent)
            except StopIteration as returned:
                return returned.value


class _DeadlineError(Exception):
    """The tool ran past its deadline (not a ``TimeoutError`` of its own)."""


def _brief(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "parameters"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def _parameters_model(
    fn: Callable[..., Any], name: str, descriptions: dict[str, str | None]
) -> type[pydantic.BaseModel]:
    try:
        signature = inspect.signature(fn)
        hints = _type_hints(fn)
    except (TypeError, ValueError, NameError) as exc:
        raise ToolDefinitionError(f"tool {name}: cannot read the signature: {exc}") from exc
    fields: dict[str, Any] = {}
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolDefinitionError(
                f"tool {name}: *args and **kwargs cannot be described to a model; "
                "name every parameter"
            )
        if param.kind is param.POSITIONAL_ONLY:
            raise ToolDefinitionError(f"tool {name}: parameter {param.name} is positional-only")
        if param.name not in hints:
            raise ToolDefinitionError(f"tool {name}: parameter {param.name!r} has no type hint")
        default = ... if param.default is param.empty else param.default
        description = descriptions.get(param.name)
        # A description in Annotated[..., Field(description=…)] wins over the docstring.
        fields[param.name] = (
            hints[param.name],
            pydantic.Field(default, description=description) if description else default,
        )
    try:
        return pydantic.create_model(
            f"{name}_parameters",
            __config__=pydantic.ConfigDict(extra="forbid", arbitrary_types_allowed=False),
            **fields,
        )
    except (pydantic.PydanticSchemaGenerationError, TypeError) as exc:
        raise ToolDefinitionError(f"tool {name}: unsupported parameter type: {exc}") from exc


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(fn, include_extras=True)


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
    concurrency_safe: bool = True,
    external: bool = False,
    group: str = DEFAULT_GROUP,
    blocking: bool = True,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
    concurrency_safe: bool = True,
    external: bool = False,
    group: str = DEFAULT_GROUP,
    blocking: bool = True,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a function a :class:`Tool` (as ``@tool`` or ``@tool(name=…)``).

    Args:
        fn: the function; sync or async, every parameter type-hinted.
        name: the tool's name; the function's name by default.
        description: for the model; the docstring (without its ``Args:``) by default.
        timeout: seconds the tool may run by default.
        concurrency_safe: whether calls may run in parallel within one agent.
        external: the agent pauses for an outside result instead of running it.
        group: the toolkit group it joins by default.
        blocking: ``False`` runs a sync function on the event loop instead of
            in a worker thread: for one that only computes, briefly (it
            cannot be stopped at its timeout).

    Raises:
        ToolDefinitionError: the function cannot be described as a tool.
    """

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(
            f,
            name=name,
            description=description,
            timeout=timeout,
            concurrency_safe=concurrency_safe,
            external=external,
            group=group,
            blocking=blocking,
        )

    return wrap(fn) if fn is not None else wrap
