"""Every NATS subject and queue group name of fleetbus, built in one place.

All subjects start with a prefix (default ``fleet``), so several fleets —
tenants, environments — share one NATS server without seeing each other::

    subjects = Subjects("fleet")
    subjects.tool("calculator")         # 'fleet.tool.calculator'
    subjects.tool_queue("calculator")   # 'tool.calculator'
    subjects.tool_control("calculator") # 'fleet.tool.calculator.control'

A reply's events travel on a subject that names whose they are, the *owner*
of the request it answers (:meth:`Subjects.events`), so that the server's
permissions, not a field a client sets, say who reads them: the owner is the
token that follows the fleet's inbox root (``_INBOX_<prefix with . as _>.``)
in the request's reply subject, which is the identity of the user the server
lets read those replies (:func:`~fleetbus.bus.inbox_prefix`).
:meth:`Subjects.reply_owner` derives it on the serving side,
:meth:`Subjects.inbox_owner` on the asking side.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from fleetbus.errors import InvalidSubjectError

__all__ = [
    "ANY_AGENT",
    "ANY_OWNER",
    "DEFAULT_PREFIX",
    "INBOX_ROOT",
    "NO_OWNER",
    "Subjects",
    "check_name",
    "check_prefix",
]

DEFAULT_PREFIX = "fleet"
"""The subject prefix when none is given."""

INBOX_ROOT = "_INBOX_"
"""The start of every fleetbus reply subject: not nats-py's ``_INBOX.``, so
a server-wide ``_INBOX.>`` permission granted to other applications does not
reach a fleet's replies."""

NO_OWNER = "_"
"""The owner token of the events of a reply no user of the fleet's inboxes
waits for: a request without a reply subject (a reply resumed after a crash
with nobody to answer), or one whose reply subject does not start with the
fleet's inbox root (a custom inbox prefix, another client library's
``_INBOX.``). Only roles granted ``<prefix>.events.*.*._`` read them (the
watcher)."""

ANY_AGENT = "*"
"""The agent token of a subscription to a session's events whichever agent
replies: a requester whose reply may be handed over to another agent."""

ANY_OWNER = "*"
"""The owner token of a subscription to a session's events whoever they are
for: a client without credentials, whose reply subjects carry no identity
(an open server checks no permissions), and the fleet's watchers."""

# A name becomes one subject token: no dots, wildcards or whitespace. Kept to
# the characters NATS micro service endpoint names accept too, so a tool name
# is also a valid endpoint name.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


@functools.lru_cache(maxsize=4096)
def _valid(name: str) -> bool:
    return isinstance(name, str) and _NAME.match(name) is not None


def check_name(name: str, *, what: str = "name") -> str:
    """Return ``name`` if it can be one subject token.

    Raises:
        InvalidSubjectError: it is empty, too long, or has characters other
            than letters, digits, ``_`` and ``-``.
    """
    if not isinstance(name, str) or not _valid(name):
        raise InvalidSubjectError(
            f"invalid {what} {name!r}: use 1-128 letters, digits, '_' or '-' "
            "(no dots, spaces or wildcards)"
        )
    return name


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is one or more valid tokens joined by dots.

    Raises:
        InvalidSubjectError: a token is empty or invalid.
    """
    for token in prefix.split("."):
        check_name(token, what="subject prefix token")
    return prefix


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subject names for one fleet (one prefix)."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        check_prefix(self.prefix)

    def tool(self, tool_name: str) -> str:
        """Request/reply subject of a tool: ``<prefix>.tool.<tool_name>``."""
        return f"{self.prefix}.tool.{check_name(tool_name, what='tool name')}"

    def tool_control(self, tool_name: str) -> str:
        """Control messages (``cancel``) for every worker of a tool:
        ``<prefix>.tool.<tool_name>.control``, no queue group.

        One token longer than :meth:`tool`, so :meth:`all_tools` (``*``)
        does not match it."""
        return f"{self.prefix}.tool.{check_name(tool_name, what='tool name')}.control"

    def tool_queue(self, tool_name: str) -> str:
        """Queue group shared by the workers of a tool: ``tool.<tool_name>``."""
        return f"tool.{check_name(tool_name, what='tool name')}"

    def agent_inbox(self, agent_name: str) -> str:
        """Direct messages to an agent: ``<prefix>.agent.<name>.inbox``."""
        return f"{self.prefix}.agent.{check_name(agent_name, what='agent name')}.inbox"

    def agent_queue(self, agent_name: str) -> str:
        """Queue group shared by the replicas of an agent: ``agent.<name>``."""
        return f"agent.{check_name(agent_name, what='agent name')}"

    def agent_control(self, agent_name: str) -> str:
        """Control messages (``cancel``) for every replica of an agent:
        ``<prefix>.agent.<name>.control``, no queue group."""
        return f"{self.prefix}.agent.{check_name(agent_name, what='agent name')}.control"

    def all_agent_inboxes(self) -> str:
        """Wildcard over every agent's inbox: ``<prefix>.agent.*.inbox`` (a host
        serving a population)."""
        return f"{self.prefix}.agent.*.inbox"

    def all_agent_controls(self) -> str:
        """Wildcard over every agent's control subject: ``<prefix>.agent.*.control``."""
        return f"{self.prefix}.agent.*.control"

    def host_queue(self, group: str) -> str:
        """Queue group shared by the replicas of an agent host: ``host.<group>``."""
        return f"host.{check_name(group, what='host group')}"

    def host_topic_queue(self, group: str) -> str:
        """Queue group in which the replicas of a host observe topics, so one
        replica records each broadcast: ``host.<group>.topics``."""
        return f"host.{check_name(group, what='host group')}.topics"

    @staticmethod
    def agent_of(subject: str) -> str:
        """The agent name in an inbox or control subject (its next-to-last token)."""
        return subject.rsplit(".", 2)[-2]

    def nobody_serves(self, subject: str) -> str:
        """Who is missing when nobody answers on ``subject``, for a person:
        ``no agent 'x' is served with prefix 'fleet'``, ``no worker serves
        the tool 'x' …``, ``no model worker serves 'x' …``."""
        own = subject.startswith(self.prefix + ".")
        tokens = subject[len(self.prefix) + 1 :].split(".") if own else []
        where = f"with prefix {self.prefix!r}"
        match tokens:
            case ["agent", name, "inbox"]:
                return f"no agent {name!r} is served {where}"
            case ["tool", name]:
                return f"no worker serves the tool {name!r} {where}"
            case ["model", name]:
                return f"no model worker serves {name!r} {where}"
        return f"nobody serves {subject}"

    def topic_queue(self, agent_name: str) -> str:
        """Queue group in which the replicas of an agent observe topics, so
        one replica records each broadcast: ``agent.<name>.topics``."""
        return f"agent.{check_name(agent_name, what='agent name')}.topics"

    def topic(self, topic: str) -> str:
        """A broadcast topic: ``<prefix>.topic.<topic>``."""
        return f"{self.prefix}.topic.{check_name(topic, what='topic')}"

    def topic_stream(self, topic: str) -> str:
        """The JetStream stream that keeps a durable topic's messages."""
        return f"{self.prefix.replace('.', '_')}_topic_{check_name(topic, what='topic')}"

    def model(self, model_name: str) -> str:
        """Request/reply subject of a model worker: ``<prefix>.model.<name>``."""
        return f"{self.prefix}.model.{check_name(model_name, what='model name')}"

    def model_queue(self, model_name: str) -> str:
        """Queue group shared by the workers of a model: ``model.<name>``."""
        return f"model.{check_name(model_name, what='model name')}"

    def events(self, agent_name: str, session_id: str, owner: str) -> str:
        """Event stream of the replies in a session that one owner asked for:
        ``<prefix>.events.<agent>.<session>.<owner>``.

        Args:
            agent_name: the agent replying, or :data:`ANY_AGENT` (``*``),
                to subscribe to the session's events whichever agent replies.
            session_id: the session.
            owner: whose request the replies answer (:meth:`reply_owner`,
                :meth:`inbox_owner`), or :data:`ANY_OWNER` (``*``), to
                subscribe to the session's events whoever asked.

        Raises:
            InvalidSubjectError: a name cannot be a subject token.
        """
        agent = agent_name if agent_name == ANY_AGENT else check_name(agent_name, what="agent name")
        session = check_name(session_id, what="session id")
        if owner != ANY_OWNER:
            check_name(owner, what="events owner")
        return f"{self.prefix}.events.{agent}.{session}.{owner}"

    def all_events(self, agent_name: str | None = None) -> str:
        """Wildcard over the event streams of one agent
        (``<prefix>.events.<agent>.>``), or of all agents
        (``<prefix>.events.>``)."""
        if agent_name is None:
            return f"{self.prefix}.events.>"
        return f"{self.prefix}.events.{check_name(agent_name, what='agent name')}.>"

    def inbox_root(self) -> str:
        """Where the fleet's reply subjects start: ``_INBOX_<prefix with . as _>``
        (followed by the identity, with credentials, then a unique token)."""
        return f"{INBOX_ROOT}{self.prefix.replace('.', '_')}"

    def reply_owner(self, reply_to: str | None) -> str:
        """The owner token of the events of a reply sent to ``reply_to``: the
        token after the fleet's inbox root (``_INBOX_<fleet>.<owner>.…``),
        with credentials the identity of the only user the server lets read
        that reply; :data:`NO_OWNER` (``_``) without a reply subject, or for
        one elsewhere (a custom inbox prefix) or whose token cannot be one.

        A requester that names another's reply subject reads neither the
        answer nor the events: both go to the user that subject belongs to.
        """
        root = self.inbox_root() + "."
        if not reply_to or not reply_to.startswith(root):
            return NO_OWNER
        owner = reply_to[len(root) :].partition(".")[0]
        return owner if _valid(owner) else NO_OWNER

    def inbox_owner(self, inbox_prefix: str) -> str:
        """The owner token a client whose replies travel under ``inbox_prefix``
        finds its replies' events under (what :meth:`reply_owner` makes of
        its reply subjects): its identity for ``_INBOX_<fleet>.<identity>``;
        :data:`ANY_OWNER` (``*``) for ``_INBOX_<fleet>`` alone (no credentials:
        each reply subject's own unique token); :data:`NO_OWNER` (``_``) for a
        prefix elsewhere."""
        root = self.inbox_root()
        if inbox_prefix == root:
            return ANY_OWNER
        return self.reply_owner(inbox_prefix + ".")

    def all_tools(self) -> str:
        """Wildcard over every tool subject of the fleet."""
        return f"{self.prefix}.tool.*"

    @staticmethod
    def kv_keys(bucket: str, keys: str) -> str:
        """The subject JetStream stores a KV bucket's ``keys`` under (a key, or
        a pattern with ``*`` / ``>``): ``$KV.<bucket>.<keys>``."""
        return f"$KV.{bucket}.{keys}"

    @staticmethod
    def kv_stream(bucket: str) -> str:
        """The JetStream stream behind a KV bucket: ``KV_<bucket>``."""
        return f"KV_{bucket}"

    def kv_writes(self, name: str, keys: str = ">") -> str:
        """Where the server repeats each stored write of KV bucket ``name``
        (with its revision), for buckets opened with ``republish``:
        ``<prefix>.kv.<name>.<keys>``."""
        return f"{self.prefix}.kv.{check_name(name, what='bucket name')}.{keys}"

    def kv_bucket(self, name: str) -> str:
        """A JetStream bucket name of this fleet (bucket names allow no dots)."""
        return f"{self.prefix.replace('.', '_')}_{check_name(name, what='bucket name')}"
