"""The NATS transport of fleetbus: connection, embedded server, subjects,
request/reply, observe, serving loops, micro-service discovery, tool calls,
and JetStream KV / object stores.

The only package that imports ``nats``.
"""

from fleetbus.bus._replies import RESEND_AFTER
from fleetbus.bus._server_version import MIN_SERVER_VERSION
from fleetbus.bus.connection import Bus, Handler, Observation, Request
from fleetbus.bus.lifecycle import GC_THRESHOLD, Lifecycle, tune_gc
from fleetbus.bus.listen import Heard, Listener
from fleetbus.bus.micro import EndpointInfo, EndpointStats, MicroService, ServiceInfo, discover
from fleetbus.bus.server import EmbeddedServer, find_server_binary
from fleetbus.bus.settings import (
    DEFAULT_URL,
    INBOX_ROOT,
    BusSettings,
    ConnectEnvironment,
    ConnectOptions,
    inbox_prefix,
    inbox_wildcard,
)
from fleetbus.bus.store import (
    Entry,
    KeyValueStore,
    ObjectStore,
    ObjectSummary,
    key_value,
    object_store,
)
from fleetbus.bus.subjects import DEFAULT_PREFIX, Subjects, check_name, check_prefix
from fleetbus.bus.tools import (
    RESULT_HEADROOM,
    RESULTS_STORE,
    SERVICE_NAME,
    CallScope,
    RemoteTool,
    ResultStore,
    ToolClient,
)
from fleetbus.bus.watch import KeyUpdates

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_URL",
    "GC_THRESHOLD",
    "INBOX_ROOT",
    "MIN_SERVER_VERSION",
    "RESEND_AFTER",
    "RESULTS_STORE",
    "RESULT_HEADROOM",
    "SERVICE_NAME",
    "Bus",
    "BusSettings",
    "CallScope",
    "ConnectEnvironment",
    "ConnectOptions",
    "EmbeddedServer",
    "EndpointInfo",
    "EndpointStats",
    "Entry",
    "Handler",
    "Heard",
    "KeyUpdates",
    "KeyValueStore",
    "Lifecycle",
    "Listener",
    "MicroService",
    "ObjectStore",
    "ObjectSummary",
    "Observation",
    "RemoteTool",
    "Request",
    "ResultStore",
    "ServiceInfo",
    "Subjects",
    "ToolClient",
    "check_name",
    "check_prefix",
    "discover",
    "find_server_binary",
    "inbox_prefix",
    "inbox_wildcard",
    "key_value",
    "object_store",
    "tune_gc",
]
