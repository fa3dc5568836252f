"""The one exception tree of fleetbus.

Every exception fleetbus raises on purpose derives from :class:`FleetbusError`.
Where a caller would naturally catch a builtin too, the class also derives from
it (``CallTimeoutError`` is a ``TimeoutError``)::

    FleetbusError
    ├── ConfigError (ValueError)             bad settings, names or arguments
    │   └── InvalidSubjectError              a name that cannot be a subject token
    ├── ProtocolError                        a message that cannot be handled
    │   ├── MalformedMessageError            not JSON, or not a JSON object
    │   ├── UnknownMessageTypeError          a ``type`` this version does not know
    │   ├── InvalidFieldError                a field of the wrong type or missing
    │   ├── UnexpectedMessageError           a valid message of the wrong type here
    │   └── UnsupportedVersionError          a higher protocol major version
    ├── BusError                             NATS transport failures
    │   ├── ConnectError (ConnectionError)   no server reachable, auth refused
    │   ├── ConnectionClosedError (ConnectionError)
    │   ├── CallTimeoutError (TimeoutError)  no reply within the deadline
    │   ├── NoRespondersError                nobody serves the subject
    │   ├── PermissionDeniedError            the server refused a publish or subscription
    │   ├── PayloadTooLargeError (ValueError)
    │   ├── RemoteError                      the peer answered with an ``error`` message
    │   ├── StoreError                       JetStream KV / object store failures
    │   │   ├── KeyNotFoundError (KeyError)
    │   │   └── RevisionMismatchError        a compare-and-set lost the race
    │   └── ServerError                      the embedded nats-server
    │       ├── ServerBinaryNotFoundError (FileNotFoundError)
    │       ├── PortInUseError (OSError)
    │       └── ServerStartError
    ├── SessionError                         an agent session on the bus
    │   ├── SessionBusyError                 another replica runs it (lease held)
    │   │   └── RequestHeldError             ...serving this very request (a copy)
    │   └── SessionNotFoundError             no such session, and none to start
    └── ToolError                            defining or looking up tools
        ├── ToolDefinitionError (TypeError)  a function that cannot become a tool
        └── UnknownToolError (KeyError)

Control-flow signals are not errors and derive from ``BaseException``, so no
``except Exception`` catch-all turns them into an answer::

    SessionLost                              this replica no longer owns the session

A tool that fails while running is not an exception: it is a ``tool_result``
with ``status="error"``. Exceptions never cross the wire.
"""

from __future__ import annotations

__all__ = [
    "BusError",
    "CallTimeoutError",
    "ConfigError",
    "ConnectError",
    "ConnectionClosedError",
    "FleetbusError",
    "InvalidFieldError",
    "InvalidSubjectError",
    "KeyNotFoundError",
    "MalformedMessageError",
    "NoRespondersError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "PortInUseError",
    "ProtocolError",
    "RemoteError",
    "RequestHeldError",
    "RevisionMismatchError",
    "ServerBinaryNotFoundError",
    "ServerError",
    "ServerStartError",
    "SessionBusyError",
    "SessionError",
    "SessionLost",
    "SessionNotFoundError",
    "StoreError",
    "ToolDefinitionError",
    "ToolError",
    "UnexpectedMessageError",
    "UnknownMessageTypeError",
    "UnknownToolError",
    "UnsupportedVersionError",
]


class FleetbusError(Exception):
    """Root of every error fleetbus raises."""


class ConfigError(FleetbusError, ValueError):
    """A setting, name or argument that fleetbus cannot use."""


class InvalidSubjectError(ConfigError):
    """A name that cannot be used as a NATS subject token."""


class ProtocolError(FleetbusError):
    """A message that cannot be handled.

    Attributes:
        code: the protocol error code to answer with (``malformed`` or
            ``unsupported_version``).
        call_id: the ``call_id`` of the offending message, when it could be read.
        session_id: its ``session_id``, when it could be read.
        message_type: its ``type``, when it could be read.
    """

    code: str = "malformed"

    def __init__(
        self,
        message: str,
        *,
        call_id: str | None = None,
        session_id: str | None = None,
        message_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.call_id = call_id
        self.session_id = session_id
        self.message_type = message_type


class MalformedMessageError(ProtocolError):
    """The payload is not JSON, or not a JSON object."""


class UnknownMessageTypeError(ProtocolError):
    """The ``type`` tag names no message of this protocol version."""


class InvalidFieldError(ProtocolError):
    """A field has the wrong type, or a required field is missing."""


class UnexpectedMessageError(ProtocolError):
    """A valid message, but not of a type this receiver accepts."""


class UnsupportedVersionError(ProtocolError):
    """The message speaks a higher protocol major version than this receiver.

    Attributes:
        version: the version the message carried.
    """

    code = "unsupported_version"

    def __init__(
        self,
        message: str,
        *,
        version: int,
        call_id: str | None = None,
        session_id: str | None = None,
        message_type: str | None = None,
    ) -> None:
        super().__init__(message, call_id=call_id, session_id=session_id, message_type=message_type)
        self.version = version


class BusError(FleetbusError):
    """A failure of the NATS transport."""


class ConnectError(BusError, ConnectionError):
    """No NATS server could be reached, or it refused the credentials."""


class ConnectionClosedError(BusError, ConnectionError):
    """The connection is closed (or draining) and cannot be used."""


class CallTimeoutError(BusError, TimeoutError):
    """No reply arrived within the deadline, after every attempt.

    Attributes:
        subject: the subject that was called.
        call_id: the ``call_id`` of the call, if it had one.
        attempts: how many times the request was sent.
    """

    def __init__(
        self, message: str, *, subject: str, call_id: str | None = None, attempts: int = 1
    ) -> None:
        super().__init__(message)
        self.subject = subject
        self.call_id = call_id
        self.attempts = attempts


class NoRespondersError(BusError):
    """Nobody is subscribed to the subject (no worker serves the tool).

    Attributes:
        subject: the subject that was called.
        call_id: the ``call_id`` of the call, if it had one.
    """

    def __init__(self, message: str, *, subject: str, call_id: str | None = None) -> None:
        super().__init__(message)
        self.subject = subject
        self.call_id = call_id


class PermissionDeniedError(BusError):
    """The server's permissions refused a publish or a subscription of this
    client (``permission denied: publish to fleet.tool.search``).

    Attributes:
        operation: ``publish`` or ``subscription``.
        subject: the subject refused.
    """

    def __init__(self, message: str, *, operation: str, subject: str) -> None:
        super().__init__(message)
        self.operation = operation
        self.subject = subject


class PayloadTooLargeError(BusError, ValueError):
    """A message is larger than the server's ``max_payload``.

    Attributes:
        size: the encoded size in bytes.
        limit: the server's limit in bytes.
    """

    def __init__(self, message: str, *, size: int, limit: int) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit


class RemoteError(BusError):
    """The peer could not handle the request and answered an ``error`` message.

    Attributes:
        code: the error code of the reply (``malformed``, ``unsupported_version``…).
        source_component: who answered.
        call_id: the ``call_id`` of the request.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str,
        source_component: str = "",
        call_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.source_component = source_component
        self.call_id = call_id


class StoreError(BusError):
    """A JetStream key-value or object store operation failed.

    Attributes:
        transient: the server did not answer, or answered that JetStream is
            unavailable for now (a stream electing a new leader after a
            cluster node died): the same operation may work in a moment.
            ``False`` for an answer that will not change (a refused write,
            data that cannot be read).
    """

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class KeyNotFoundError(StoreError, KeyError):
    """The key (or object) does not exist in the bucket."""

    def __str__(self) -> str:
        # KeyError's str() wraps the message in quotes; keep it readable.
        return str(self.args[0]) if self.args else ""


class RevisionMismatchError(StoreError):
    """A compare-and-set write found another revision than expected.

    Attributes:
        key: the key written.
        expected: the revision the writer had read.
    """

    def __init__(self, message: str, *, key: str, expected: int | None) -> None:
        super().__init__(message)
        self.key = key
        self.expected = expected


class ServerError(BusError):
    """The embedded nats-server could not be started or stopped."""


class ServerBinaryNotFoundError(ServerError, FileNotFoundError):
    """The ``nats-server`` binary is not installed where fleetbus looks."""


class PortInUseError(ServerError, OSError):
    """The port the embedded server was asked to listen on is taken."""


class ServerStartError(ServerError):
    """nats-server exited or did not become ready in time."""


class SessionError(FleetbusError):
    """An agent session kept in JetStream could not be used.

    Attributes:
        agent: the agent's name.
        session_id: the session.
    """

    def __init__(self, message: str, *, agent: str, session_id: str) -> None:
        super().__init__(message)
        self.agent = agent
        self.session_id = session_id


class SessionBusyError(SessionError):
    """Another replica holds the session's lease and is running it."""


class RequestHeldError(SessionBusyError):
    """Another replica holds the session's lease serving this very request
    (a copy sent again by a client that had no receipt): it answers."""


class SessionNotFoundError(SessionError):
    """The session does not exist (and the message could not start one)."""


class SessionLost(BaseException):
    """Control flow, not an error: this replica no longer owns the session
    (another took it over after its lease lapsed, or the store could not be
    written for longer than the lease lasts). The replica stops the reply
    quietly; the session's owner answers.

    Attributes:
        agent: the agent's name.
        session_id: the session.
    """

    def __init__(self, message: str, *, agent: str, session_id: str) -> None:
        super().__init__(message)
        self.agent = agent
        self.session_id = session_id


class ToolError(FleetbusError):
    """Defining, registering or looking up a tool failed."""


class ToolDefinitionError(ToolError, TypeError):
    """A function cannot become a tool (missing hints, unsupported signature)."""


class UnknownToolError(ToolError, KeyError):
    """No tool of that name is known.

    Attributes:
        tool_name: the name asked for.
        available: the names that do exist.
    """

    def __init__(self, tool_name: str, available: list[str]) -> None:
        names = ", ".join(sorted(available)) or "none"
        super().__init__(f"unknown tool {tool_name!r}; available tools: {names}")
        self.tool_name = tool_name
        self.available = sorted(available)

    def __str__(self) -> str:
        return str(self.args[0])
