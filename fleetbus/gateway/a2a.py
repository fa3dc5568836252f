"""A2A: every agent of the fleet as an A2A agent (a2a-sdk 1.x, JSON-RPC).

Routes, per agent, both needing a token (``Authorization: Bearer TOKEN``):

``GET /a2a/{agent}/.well-known/agent-card.json``
    the agent's card: its name and description, one skill for the agent
    itself and one per tool of its toolkit, streaming, a bearer security
    scheme, and the JSON-RPC endpoint ``<public URL>/a2a/{agent}``, listed
    for A2A 1.0 and for A2A 0.3 (whose clients read the card's ``url``).
``POST /a2a/{agent}``
    JSON-RPC 2.0. A2A 1.0's ``SendMessage``, ``SendStreamingMessage``
    (Server-Sent Events), ``GetTask`` and ``CancelTask`` (with the header
    ``A2A-Version: 1.0``, as a2a-sdk 1.x clients send it), and A2A 0.3's
    ``message/send``, ``message/stream``, ``tasks/get`` and ``tasks/cancel``
    (no header). Task listing, resubscription, push notifications and the
    extended card are not offered.

What is what:

- a ``contextId`` is a conversation of the caller's: the session
  ``<caller's tag>-<contextId>`` (``GatewayFleet.session_id``); a message
  without one starts a new conversation, whose ``contextId`` the task gives.
- a task is one reply: the request and what the agent does until its final
  answer. Its id is ``<agent>.<session>.<mark>``; the request carries the mark
  in its ``metadata`` (``a2a_task``), which the user message in the session's
  memory keeps. So any replica answers ``GetTask`` from the session's journal
  alone: running → ``working``; paused → ``input-required``, the calls it
  waits for in the status message; done → ``completed``, the answer as the
  artifact ``answer`` (a data part when the reply gave a structured answer,
  else a text part); ``error`` → ``failed``; interrupted → ``canceled``. A
  task that is not the conversation's last any more is ``completed`` with the
  last answer it gave; one whose request a memory compression summarised is
  no longer found.
- a message's text parts are the request's text, its data parts their JSON;
  ``metadata.output_schema`` (a JSON Schema of an object) asks for a
  structured answer.
- a paused task is continued by a message with its ``taskId`` whose content
  answers it: the text ``yes`` or ``no`` (also ``y``, ``allow``, ``approve``,
  ``ok``, ``go ahead`` / ``n``, ``deny``, ``reject``, ``stop``; any case, a
  trailing ``.`` or ``!`` allowed) allows or denies every call waiting for confirmation; a
  data part ``{"confirm": {"<call_id>": true | false, …}}`` decides each call
  named; a data part ``{"results": {"<call_id>": <any JSON>, …}}`` gives the
  results of calls run outside the agent.
- ``CancelTask`` interrupts the running reply and answers the task once the
  session says how it ended (within :data:`CANCEL_WAIT` seconds); a task
  that waits for input is not cancelled (deny its calls: answer ``no``).

With ``returnImmediately``, a message is answered ``working`` once the
agent has taken it, and the reply runs on in its session.

Streamed, a task sends: the task (``working``); a status update per piece
of text (a text part) and per tool call and result (a data part: the event's
data), each with ``metadata.event`` naming the fleetbus event; at the end the
answer as an artifact update, then the final status.

Errors: no token, or an unknown one → HTTP 401; an agent the token may not
talk to → HTTP 404 (for the card, also an agent not served); a task that is
not the caller's, or not found → ``TaskNotFoundError`` (-32001); a message
that cannot be sent as it is → ``InvalidParamsError`` (-32602); the token's
limit of open replies → ``InvalidRequestError`` (-32600); an agent not
served, not answering in time, or answering an error → ``InternalError``
(-32603).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from a2a.server.context import ServerCallContext
from a2a.server.events import Event as A2AEvent
from a2a.server.request_handlers import RequestHandler
from a2a.server.request_handlers.response_helpers import agent_card_to_dict
from a2a.server.routes import DefaultServerCallContextBuilder, create_jsonrpc_routes
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    HTTPAuthSecurityScheme,
    InternalError,
    InvalidParamsError,
    InvalidRequestError,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    PushNotificationNotSupportedError,
    SecurityRequirement,
    SecurityScheme,
    SendMessageRequest,
    StringList,
    SubscribeToTaskRequest,
    Task,
    TaskNotCancelableError,
    TaskNotFoundError,
    TaskPushNotificationConfig,
    TaskState,
    UnsupportedOperationError,
)
from a2a.utils.errors import A2AError
from a2a.utils.proto_utils import validate_proto_required_fields
from a2a.utils.task import apply_history_length, validate_history_length
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetbus._version import __version__
from fleetbus.agents.serving.directory import AgentInfo
from fleetbus.agents.serving.facts import SessionRecord
from fleetbus.agents.state import PendingCall
from fleetbus.errors import (
    CallTimeoutError,
    ConfigError,
    FleetbusError,
    NoRespondersError,
    RemoteError,
)
from fleetbus.gateway._a2a_tasks import (
    INPUT_REQUIRED,
    TASK_MARK,
    WORKING,
    TaskRef,
    answer_to,
    context_of,
    end_events,
    make_task,
    message_content,
    outcome,
    progress,
    stamped,
    struct_json,
    task_of,
)
from fleetbus.gateway._common import authenticated, content_text, error_body
from fleetbus.gateway.auth import Caller, Unauthorized
from fleetbus.gateway.fleet import Ask, GatewayFleet, NotFound, TooManyStreams
from fleetbus.protocol import FinalAnswer, UserRequest, new_id

__all__ = ["CANCEL_WAIT", "TASK_MARK", "FleetRequestHandler", "add_a2a_routes", "agent_card"]

logger = logging.getLogger(__name__)

CANCEL_WAIT: Final = 10.0
"""Seconds ``CancelTask`` waits for the session to say how the reply ended."""

CARD_PATH: Final = "/.well-known/agent-card.json"
"""Where an agent's card is, under its URL (where a2a-sdk's resolver looks)."""

_CALLER: Final = "fleetbus.caller"
_AGENT: Final = "fleetbus.agent"
_MODES: Final = ["text/plain", "application/json"]


def add_a2a_routes(
    app: Starlette,
    fleet: GatewayFleet,
    *,
    public_url: str | None = None,
    authenticate: Callable[[Request], Caller] | None = None,
) -> None:
    """Serve every agent of ``fleet`` over A2A on ``app`` (see the module docstring).

    Args:
        app: the application (FastAPI or Starlette).
        fleet: the fleet the gateway serves.
        public_url: the URL clients reach the gateway at, for the cards'
            interface URLs; the request's own by default.
        authenticate: who sends a request; raises
            :class:`~fleetbus.gateway.auth.Unauthorized`. By default the
            tokens of ``app.state.tokens`` (``Authorization: Bearer`` or
            ``x-api-key``).
    """
    who = authenticate or authenticated
    handler = FleetRequestHandler(fleet)
    rpc = create_jsonrpc_routes(
        handler, "/a2a/{agent}", context_builder=_CallContexts(), enable_v0_3_compat=True
    )[0]
    dispatch = rpc.endpoint

    async def card(request: Request) -> Response:
        try:
            info = await fleet.agent(who(request), request.path_params["agent"])
        except FleetbusError as exc:
            return _error(exc)
        base = (public_url or str(request.base_url)).rstrip("/")
        return JSONResponse(agent_card_to_dict(agent_card(info, f"{base}/a2a/{info.name}")))

    async def endpoint(request: Request) -> Response:
        try:
            caller = who(request)
            agent = fleet.check_agent(caller, request.path_params["agent"])
        except FleetbusError as exc:
            if isinstance(exc, Unauthorized):
                body = {
                    "jsonrpc": "2.0",
                    "id": None,
                    "error": {"code": -32600, "message": str(exc)},
                }
                return JSONResponse(body, status_code=401, headers={"www-authenticate": "Bearer"})
            return _error(exc)
        request.state.a2a = (caller, agent)
        response: Response = await dispatch(request)
        return response

    app.router.routes.append(Route("/a2a/{agent}" + CARD_PATH, card, methods=["GET"]))
    app.router.routes.append(Route("/a2a/{agent}", endpoint, methods=["POST"]))


def agent_card(info: AgentInfo, url: str) -> AgentCard:
    """The A2A card of a served agent whose JSON-RPC endpoint is ``url``."""
    skills = [
        AgentSkill(
            id=info.name,
            name=info.name,
            description=info.description or f"Talk with the agent {info.name}.",
            tags=["agent"],
        )
    ]
    skills.extend(
        AgentSkill(
            id=f"tool:{t.name}",
            name=t.name,
            description=t.description or f"The tool {t.name}.",
            tags=["tool"],
        )
        for t in info.tools
    )
    return AgentCard(
        name=info.name,
        description=info.description or f"The fleetbus agent {info.name}.",
        # One endpoint, both versions: A2A 0.3 clients read the card's
        # top-level url (written from the 0.3 interface) and use 0.3's names.
        supported_interfaces=[
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version=version)
            for version in ("1.0", "0.3")
        ],
        version=__version__,
        capabilities=AgentCapabilities(streaming=True, push_notifications=False),
        security_schemes={
            "bearer": SecurityScheme(
                http_auth_security_scheme=HTTPAuthSecurityScheme(
                    scheme="bearer", description="a token of the gateway's tokens"
                )
            )
        },
        security_requirements=[SecurityRequirement(schemes={"bearer": StringList()})],
        default_input_modes=_MODES,
        default_output_modes=_MODES,
        skills=skills,
    )


def _error(exc: FleetbusError) -> Response:
    status, body = error_body(exc)
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


class _CallContexts(DefaultServerCallContextBuilder):
    """Call contexts that carry the caller and the agent the route named."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        caller, agent = request.state.a2a
        context.state[_CALLER] = caller
        context.state[_AGENT] = agent
        return context


@dataclass(frozen=True, slots=True)
class _Start:
    """A message to send, and the task it starts or continues."""

    ref: TaskRef
    context_id: str
    asking: Ask
    schema: dict[str, Any] | None
    history: list[Message]
    """The task's messages, this one last."""


class FleetRequestHandler(RequestHandler):
    """a2a-sdk's request handler over a :class:`GatewayFleet`: the fleet is
    the task store and the runner, so nothing is kept between requests (see
    the module docstring).

    The call context's state carries the caller and the agent of the route
    (set by :func:`add_a2a_routes`).
    """

    def __init__(self, fleet: GatewayFleet) -> None:
        self.fleet = fleet

    # -- messages ------------------------------------------------------------------------

    async def on_message_send(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Task | Message:
        """Send the message and answer the task once the reply ends (or at
        once, ``working``, with ``returnImmediately``: the reply goes on)."""
        validate_proto_required_fields(params)
        validate_history_length(params.configuration)
        caller, agent = _who(context)
        start = await self._start(caller, agent, params)
        history = start.history
        at_once = params.configuration.return_immediately
        with _translated():
            stream = self.fleet.stream(
                caller,
                agent,
                start.ref.session_id,
                start.asking,
                schema=start.schema,
                detach=True if at_once else None,
            )
            async with contextlib.aclosing(stream):
                async for item in stream:
                    if isinstance(item, FinalAnswer):
                        task = await self._ended(start.ref, start.context_id, history, item)
                        return apply_history_length(task, params.configuration)
                    if at_once:
                        break
        return apply_history_length(
            make_task(start.ref, start.context_id, WORKING, history), params.configuration
        )

    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[A2AEvent, None]:
        """Send the message and stream the task: the task, progress, the end."""
        validate_proto_required_fields(params)
        validate_history_length(params.configuration)
        caller, agent = _who(context)
        start = await self._start(caller, agent, params)
        ref, context_id = start.ref, start.context_id
        with _translated():
            stream = self.fleet.stream(
                caller, agent, ref.session_id, start.asking, schema=start.schema
            )
            async with contextlib.aclosing(stream):
                # The first item is awaited before anything is sent: a reply
                # that cannot start is an error answer, not a broken stream.
                item = await anext(stream)
                task = make_task(ref, context_id, WORKING, start.history)
                yield apply_history_length(task, params.configuration)
                while True:
                    if isinstance(item, FinalAnswer):
                        ended = await self._ended(ref, context_id, start.history, item)
                        for event in end_events(ended):
                            yield event
                        return
                    told = progress(ref, context_id, item)
                    if told is not None:
                        yield told
                    item = await anext(stream)

    async def _start(self, caller: Caller, agent: str, params: SendMessageRequest) -> _Start:
        """What to send for ``params``: a new request (a new task), or the
        answer to the paused task the message names.

        Raises:
            InvalidParamsError: the message cannot be sent as it is.
            TaskNotFoundError: it names a task that is not the caller's.
        """
        message = params.message
        if message.task_id:
            return await self._resume(caller, agent, message)
        with _translated(InvalidParamsError):
            session = self.fleet.session_id(caller, message.context_id or None)
        ref = TaskRef(agent, session, new_id())
        context_id = context_of(caller, session)
        metadata = struct_json(message.metadata) if message.HasField("metadata") else {}
        schema = metadata.get("output_schema")
        if schema is not None and not isinstance(schema, dict):
            raise InvalidParamsError("metadata.output_schema must be a JSON Schema (an object)")
        asking = UserRequest(
            sender=caller.user,
            content=message_content(message.parts),
            metadata={TASK_MARK: ref.mark},
        )
        return _Start(ref, context_id, asking, schema, [stamped(message, ref, context_id)])

    async def _resume(self, caller: Caller, agent: str, message: Message) -> _Start:
        ref = TaskRef.parse(message.task_id, agent)
        context_id = context_of(caller, ref.session_id)
        if message.context_id:
            with _translated(InvalidParamsError):
                named = self.fleet.session_id(caller, message.context_id)
            if named != ref.session_id:
                raise InvalidParamsError(
                    f"context {message.context_id!r} is not that of task {message.task_id!r}"
                )
        record = await self._record(caller, ref)
        task = task_of(record, ref, context_id)
        state = task.status.state
        if state != INPUT_REQUIRED:
            raise InvalidParamsError(
                f"task {ref.task_id} does not wait for input ({TaskState.Name(state)}): "
                "send a message without a taskId to start another"
            )
        asking = answer_to(message, record.state.reply.pending if record.state.reply else [])
        asking = _signed(asking, caller.user, ref.session_id)
        history = [*task.history, stamped(message, ref, context_id)]
        return _Start(ref, context_id, asking, None, history)

    async def _ended(
        self, ref: TaskRef, context_id: str, history: list[Message], final: FinalAnswer
    ) -> Task:
        """The task a final answer ends (the calls it waits for, when paused)."""
        pending: list[PendingCall] = []
        if final.finished_reason == "paused":
            with _translated():
                pending = await self.fleet.pending(ref.agent, ref.session_id)
        return outcome(
            ref,
            context_id,
            history,
            reason=final.finished_reason,
            text=content_text(final.content),
            structured=final.structured,
            pending=pending,
        )

    # -- tasks ---------------------------------------------------------------------------

    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task:
        """The task as the session's journal tells it now."""
        validate_proto_required_fields(params)
        validate_history_length(params)
        caller, agent = _who(context)
        ref = TaskRef.parse(params.id, agent)
        record = await self._record(caller, ref)
        return apply_history_length(
            task_of(record, ref, context_of(caller, ref.session_id)), params
        )

    async def on_cancel_task(self, params: CancelTaskRequest, context: ServerCallContext) -> Task:
        """Interrupt the task's reply; the task once the session says how it
        ended (or as it stands after :data:`CANCEL_WAIT` seconds)."""
        validate_proto_required_fields(params)
        caller, agent = _who(context)
        ref = TaskRef.parse(params.id, agent)
        context_id = context_of(caller, ref.session_id)
        record = await self._record(caller, ref)
        task = task_of(record, ref, context_id)
        if task.status.state == INPUT_REQUIRED:
            raise TaskNotCancelableError(
                f"task {ref.task_id} waits for input: answer 'no' to deny its calls"
            )
        if task.status.state != WORKING:
            raise TaskNotCancelableError(
                f"task {ref.task_id} is over ({TaskState.Name(task.status.state)})"
            )
        with _translated():
            await self.fleet.cancel(caller, agent, ref.session_id)
        record = await self._settled(caller, ref, record)
        return task_of(record, ref, context_id)

    async def _record(self, caller: Caller, ref: TaskRef) -> SessionRecord:
        try:
            return await self.fleet.session(caller, ref.agent, ref.session_id)
        except NotFound:
            raise TaskNotFoundError(f"no task {ref.task_id!r}") from None
        except FleetbusError as exc:
            raise InternalError(str(exc)) from exc

    async def _settled(self, caller: Caller, ref: TaskRef, seen: SessionRecord) -> SessionRecord:
        """The session once its journal says the reply running at ``seen``
        is over (or after :data:`CANCEL_WAIT` seconds)."""
        try:
            journals = await self.fleet.journals()
            async with asyncio.timeout(CANCEL_WAIT):
                facts = journals.follow(ref.agent, ref.session_id)
                try:
                    async for fact in facts:
                        # Facts read back are those up to `seen` and after
                        # it; live ones have no sequence yet (0).
                        late = fact.seq == 0 or fact.seq > seen.seq
                        if late and fact.status is not None and fact.status != "running":
                            break
                finally:
                    closing = getattr(facts, "aclose", None)
                    if closing is not None:
                        await closing()
        except TimeoutError:
            logger.info(
                "task %s: not over %gs after its cancel",
                ref.task_id,
                CANCEL_WAIT,
                extra={"session_id": ref.session_id},
            )
        except FleetbusError as exc:
            logger.warning("task %s: cannot follow its session: %s", ref.task_id, exc)
        return await self._record(caller, ref)

    async def on_list_tasks(
        self, params: ListTasksRequest, context: ServerCallContext
    ) -> ListTasksResponse:
        """Not offered."""
        raise UnsupportedOperationError("listing tasks is not offered")

    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[A2AEvent, None]:
        """Not offered."""
        nothing: tuple[A2AEvent, ...] = ()
        for event in nothing:  # an async generator, as the interface has it
            yield event
        raise UnsupportedOperationError("resubscribing is not offered: poll GetTask")

    async def on_create_task_push_notification_config(
        self, params: TaskPushNotificationConfig, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        """Not offered."""
        raise PushNotificationNotSupportedError

    async def on_get_task_push_notification_config(
        self, params: GetTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        """Not offered."""
        raise PushNotificationNotSupportedError

    async def on_list_task_push_notification_configs(
        self, params: ListTaskPushNotificationConfigsRequest, context: ServerCallContext
    ) -> ListTaskPushNotificationConfigsResponse:
        """Not offered."""
        raise PushNotificationNotSupportedError

    async def on_delete_task_push_notification_config(
        self, params: DeleteTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> None:
        """Not offered."""
        raise PushNotificationNotSupportedError

    async def on_get_extended_agent_card(
        self, params: GetExtendedAgentCardRequest, context: ServerCallContext
    ) -> AgentCard:
        """Not offered: the card is the same for every caller."""
        raise UnsupportedOperationError("there is no extended card")


# -- requests ------------------------------------------------------------------------------


def _who(context: ServerCallContext) -> tuple[Caller, str]:
    caller: Caller = context.state[_CALLER]
    agent: str = context.state[_AGENT]
    return caller, agent


@contextlib.contextmanager
def _translated(kind: type[A2AError] = InternalError) -> Iterator[None]:
    """fleetbus errors as A2A errors (``kind`` for a ``NotFound``)."""
    try:
        yield
    except NotFound as exc:
        raise kind(str(exc)) from exc
    except TooManyStreams as exc:
        raise InvalidRequestError(str(exc)) from exc
    except ConfigError as exc:
        raise InvalidParamsError(str(exc)) from exc
    except (NoRespondersError, CallTimeoutError, RemoteError) as exc:
        raise InternalError(str(exc)) from exc


def _signed(asking: Ask, sender: str, session_id: str) -> Ask:
    """``asking`` as ``sender``'s, in ``session_id``."""
    return msgspec.structs.replace(asking, sender=sender, session_id=session_id)
