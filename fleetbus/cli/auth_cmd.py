"""``fleetbus auth``: the nats-server ``authorization`` block of a fleet, one
user per role, each allowed exactly the subjects its role uses.

Roles and what they may do (``P`` the prefix, ``B`` the prefix with ``_``
for ``.``; every user also subscribes to its own inboxes,
``_INBOX_B.<user>.>``, where its requests' replies and JetStream's answers
come; a user that asks agents reads the events of the replies it asked for,
``P.events.*.*.<user>``, the events subjects' last token being whose request
a reply answers):

============  ================================================================
role          allowed
============  ================================================================
tool-worker   serve ``P.tool.*`` and ``P.tool.*.control``, answer ``$SRV``
              discovery (``fleetbus`` service), answer each request once
              (``allow_responses``); write the ``B_tool_results`` object store
agent         serve ``P.agent.*.inbox`` / ``.control`` (or only its own with
              a name), answer ``$SRV`` discovery (``fleetbus-agents``),
              observe ``P.topic.*`` and ``P.kv.session_leases.>``;
              call tools, models and agents (reading its own replies'
              events), publish events (``P.events.<agent>.*.*``) and topics,
              discover tools and models; answer any inbox of the fleet (a
              replica that takes a session over answers the request another
              received); the session journals (stream ``B_session``,
              its own ``P.session.<name>.*``), leases, durable topic streams, the
              ``B_offload`` object store (long tool results kept whole),
              and reading ``B_tool_results``
model-worker  serve ``P.model.*``, answer ``$SRV`` discovery
              (``fleetbus-models``), stream the deltas of an answer to the
              request's inbox (``allow_responses``, 10 minutes)
client        call tools (``fleetbus call``), ask and cancel agents
              (``fleetbus ask``), read its replies' events
              (``P.events.*.*.<user>``), discover tools, read
              ``B_tool_results``
gateway       a front end serving many people, which filters what each may
              see itself: ask and cancel agents, read its replies' events,
              discover agents (``$SRV.PING|INFO|STATS.fleetbus-agents``);
              read, never write, the session journals (stream ``B_session``:
              its info, direct and message gets, and its subjects
              ``P.session.*.*`` as they are appended), the lease bucket
              ``B_session_leases`` and the object store ``B_session_blobs``
watcher       read everything of the fleet: ``P.>`` and ``_INBOX_B.>``
============  ================================================================

A JetStream bucket is reached through API subjects that name its stream
(``$JS.API.STREAM.INFO.KV_B_session_leases``…) and, to write, through its own
subjects (``$KV.B_session_leases.>``, ``P.session.<agent>.*``,
``$O.B_tool_results.>``): each role gets
those of its buckets only. Identities are user names with passwords (given,
generated, or read by the server from its environment) or NKEYs (seeds
generated here, written to files only their owner reads).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import nkeys  # type: ignore[import-untyped]

from fleetbus.bus import (
    SERVICE_NAME,
    ConnectOptions,
    Subjects,
    check_name,
    check_prefix,
    inbox_prefix,
    inbox_wildcard,
)
from fleetbus.bus.subjects import ANY_OWNER, NO_OWNER
from fleetbus.cli._common import Subcommands, err_console
from fleetbus.errors import ConfigError

__all__ = [
    "AGENT_SERVICE",
    "ROLES",
    "RolePermissions",
    "User",
    "add_parser",
    "authorization",
    "cmd",
    "role_permissions",
]

ROLES = ("tool-worker", "agent", "model-worker", "client", "gateway", "watcher")
"""Every role ``fleetbus auth`` makes a user for."""

AGENT_SERVICE = "fleetbus-agents"
"""The NATS micro service name agent hosts register under
(:data:`fleetbus.agents.serving.AGENT_SERVICE_NAME`; named here so that the
command line's parser imports no agent code)."""

MODEL_SERVICE = "fleetbus-models"
"""The NATS micro service name model workers register under."""

MODEL_REPLY_WINDOW = "10m"
"""How long a model worker may stream the answer to one prompt."""

MODEL_REPLY_MESSAGES = 100_000
"""How many messages (deltas, then the answer) it may send to one prompt."""

_SESSION_KV = ("session_leases",)
_JOURNAL = "session"
_SESSION_OBJECTS = ("session_blobs",)
_RESULTS = "tool_results"
_OFFLOAD = "offload"
_SRV_VERBS = ("PING", "INFO", "STATS")
_ENV_NAME = re.compile(r"[^A-Z0-9]")


@dataclass(frozen=True, slots=True)
class RolePermissions:
    """What one user may publish and subscribe to.

    Attributes:
        publish: subjects it may publish to (wildcards allowed).
        subscribe: subjects it may subscribe to.
        responses: ``(max messages, expiry or None)`` of ``allow_responses``:
            how it may answer the requests it receives; ``None``: not at all
            beyond ``publish``.
    """

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responses: tuple[int, str | None] | None = None


@dataclass(frozen=True, slots=True)
class User:
    """One identity of the block.

    Attributes:
        role: one of :data:`ROLES`.
        user: the user name (with ``password``), or ``None`` for an NKEY user.
        password: the password, or ``$VARIABLE`` for one the server reads
            from its environment.
        nkey: the NKEY public key (``U…``) of an NKEY user.
        name: an agent's or a client's name: an agent user serves only that
            agent's subjects; a client user is one person or program.
    """

    role: str
    user: str | None = None
    password: str | None = None
    nkey: str | None = None
    name: str | None = None
    note: str = field(default="", compare=False)

    @property
    def identity(self) -> str:
        """What the client's inbox prefix is made of: the user name or the key."""
        identity = self.user or self.nkey
        if not identity:
            raise ConfigError(f"a {self.role} user needs a user name or an NKEY")
        return identity


def _js_api(stream: str, *, write: bool) -> list[str]:
    """The JetStream API subjects to use (``write``: also make and change)
    the stream ``stream``."""
    api = "$JS.API"
    subjects = [
        f"{api}.STREAM.INFO.{stream}",
        f"{api}.STREAM.MSG.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}.>",
        f"{api}.CONSUMER.CREATE.{stream}",
        f"{api}.CONSUMER.CREATE.{stream}.>",
        f"{api}.CONSUMER.INFO.{stream}.*",
        f"{api}.CONSUMER.DELETE.{stream}.*",
        f"$JS.FC.{stream}.>",
    ]
    if write:
        subjects += [
            f"{api}.STREAM.CREATE.{stream}",
            f"{api}.STREAM.UPDATE.{stream}",
            f"{api}.STREAM.PURGE.{stream}",
            f"{api}.STREAM.MSG.DELETE.{stream}",
        ]
    return subjects


def _kv(fleet: str, name: str, *, write: bool = True) -> list[str]:
    bucket = f"{fleet}_{name}"
    return _js_api(f"KV_{bucket}", write=write) + ([f"$KV.{bucket}.>"] if write else [])


def _objects(fleet: str, name: str, *, write: bool) -> list[str]:
    bucket = f"{fleet}_{name}"
    # Reading an object finds its stream by subject (STREAM.NAMES: names only).
    subjects = [*_js_api(f"OBJ_{bucket}", write=write), "$JS.API.STREAM.NAMES"]
    return subjects + ([f"$O.{bucket}.>"] if write else [])


def _durable_topic(fleet: str, topic: str) -> list[str]:
    stream = f"{fleet}_topic_{topic}"
    return [
        *_js_api(stream, write=True),
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.*",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
        f"$JS.ACK.{stream}.>",
    ]


def _js_read(stream: str) -> list[str]:
    """The JetStream API subjects to read the stream ``stream`` message by
    message (its info, direct and message gets), with no consumer."""
    api = "$JS.API"
    return [
        f"{api}.STREAM.INFO.{stream}",
        f"{api}.STREAM.MSG.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}.>",
    ]


def _own_events(p: str, identity: str) -> str:
    """The events subjects of the replies ``identity`` asks for:
    ``P.events.*.*.<identity's owner token>``.

    Raises:
        ConfigError: the identity makes no owner token of its own.
    """
    subjects = Subjects(p)
    owner = subjects.inbox_owner(inbox_prefix(p, identity))
    if owner in (NO_OWNER, ANY_OWNER):
        raise ConfigError(
            f"the identity {identity!r} cannot own events: as a subject token it reads "
            f"{owner!r} (use letters, digits, '-' or '_', at most 128)"
        )
    return f"{p}.events.*.*.{owner}"


def _service(name: str) -> list[str]:
    """The ``$SRV`` subjects a NATS micro service ``name`` answers on."""
    return [
        *(f"$SRV.{verb}" for verb in _SRV_VERBS),
        f"$SRV.*.{name}",
        f"$SRV.*.{name}.*",
    ]


def role_permissions(
    prefix: str,
    role: str,
    *,
    identity: str,
    name: str | None = None,
    topics: Iterable[str] = (),
    simulations: Iterable[str] = (),
) -> RolePermissions:
    """What a user of ``role`` in the fleet ``prefix`` may do.

    Args:
        prefix: the fleet's subject prefix.
        role: one of :data:`ROLES`.
        identity: the user name or NKEY public key (its inboxes are allowed).
        name: for an agent, the only agent it serves (all when ``None``).
        topics: durable topics agents keep in JetStream (``--durable-topics``).
        simulations: simulation environments (KV buckets ``sim_<name>``) that
            agents and tool workers (whose tools use them) read and write.

    Raises:
        ConfigError: an unknown role, or an invalid prefix, name or topic.
    """
    p = check_prefix(prefix)
    fleet = p.replace(".", "_")
    own = [inbox_wildcard(p, identity)]
    sims = [
        s for sim in simulations for s in _kv(fleet, f"sim_{check_name(sim, what='simulation')}")
    ]
    if role == "tool-worker":
        return RolePermissions(
            publish=(*_objects(fleet, _RESULTS, write=True), *sims),
            subscribe=(f"{p}.tool.*", f"{p}.tool.*.control", *_service(SERVICE_NAME), *own),
            responses=(1, None),
        )
    if role == "agent":
        agent = "*" if name is None else check_name(name, what="agent name")
        events = _own_events(p, identity)
        stores = [s for kv in _SESSION_KV for s in _kv(fleet, kv)]
        stores += _js_api(f"{fleet}_{_JOURNAL}", write=True)
        stores += [s for obj in _SESSION_OBJECTS for s in _objects(fleet, obj, write=True)]
        stores += _objects(fleet, _OFFLOAD, write=True)
        stores += _objects(fleet, _RESULTS, write=False)
        durable = [s for t in topics for s in _durable_topic(fleet, check_name(t, what="topic"))]
        return RolePermissions(
            publish=(
                f"{p}.tool.*",
                f"{p}.tool.*.control",
                f"{p}.model.*",
                f"{p}.agent.*.inbox",
                f"{p}.topic.*",
                f"{p}.events.{agent}.*.*",
                f"{p}.{_JOURNAL}.{agent}.*",
                f"$SRV.INFO.{SERVICE_NAME}",
                f"$SRV.INFO.{MODEL_SERVICE}",
                inbox_wildcard(p),
                *dict.fromkeys(stores),
                *durable,
                *sims,
            ),
            subscribe=(
                f"{p}.agent.{agent}.inbox",
                f"{p}.agent.{agent}.control",
                f"{p}.topic.*",
                f"{p}.kv.session_leases.>",
                events,
                *_service(AGENT_SERVICE),
                *own,
            ),
        )
    if role == "model-worker":
        return RolePermissions(
            publish=(),
            subscribe=(f"{p}.model.*", *_service(MODEL_SERVICE), *own),
            responses=(MODEL_REPLY_MESSAGES, MODEL_REPLY_WINDOW),
        )
    if role == "client":
        return RolePermissions(
            publish=(
                f"{p}.tool.*",
                f"{p}.tool.*.control",
                f"{p}.agent.*.inbox",
                f"{p}.agent.*.control",
                f"$SRV.INFO.{SERVICE_NAME}",
                *_objects(fleet, _RESULTS, write=False),
            ),
            subscribe=(_own_events(p, identity), *own),
        )
    if role == "gateway":
        stores = _js_read(f"{fleet}_{_JOURNAL}")
        stores += [s for kv in _SESSION_KV for s in _kv(fleet, kv, write=False)]
        stores += [s for obj in _SESSION_OBJECTS for s in _objects(fleet, obj, write=False)]
        return RolePermissions(
            publish=(
                f"{p}.agent.*.inbox",
                f"{p}.agent.*.control",
                *(f"$SRV.{verb}.{AGENT_SERVICE}" for verb in _SRV_VERBS),
                *dict.fromkeys(stores),
            ),
            subscribe=(_own_events(p, identity), f"{p}.{_JOURNAL}.*.*", *own),
        )
    if role == "watcher":
        return RolePermissions(publish=(), subscribe=(f"{p}.>", inbox_wildcard(p)))
    raise ConfigError(f"unknown role {role!r}; the roles are {', '.join(ROLES)}")


def authorization(
    prefix: str,
    users: Sequence[User],
    *,
    topics: Iterable[str] = (),
    simulations: Iterable[str] = (),
) -> str:
    """The nats-server ``authorization { users = [...] }`` block for ``users``.

    Args:
        prefix: the fleet's subject prefix.
        users: one entry per identity (see :func:`role_permissions` for what
            each role may do).
        topics: durable topics the agents keep in JetStream.
        simulations: simulation environments the agents and tools use.

    Raises:
        ConfigError: an unknown role, a user without an identity, or an
            invalid prefix, name or topic.
    """
    topics, simulations = list(topics), list(simulations)
    lines = [f"# fleet {check_prefix(prefix)}: written by fleetbus auth", "authorization {"]
    lines.append("  users = [")
    for user in users:
        granted = role_permissions(
            prefix,
            user.role,
            identity=user.identity,
            name=user.name,
            topics=topics,
            simulations=simulations,
        )
        lines.append(f"    # {user.note or user.role}")
        lines.append("    {")
        if user.nkey:
            lines.append(f"      nkey: {_quote(user.nkey)}")
        else:
            lines.append(f"      user: {_quote(user.identity)}")
            if user.password is not None:
                lines.append(f"      password: {_value(user.password)}")
        lines.append("      permissions: {")
        if granted.publish or granted.responses is None:
            # allow_responses alone denies every other publish.
            lines.append(f"        publish: {_allow(granted.publish)}")
        lines.append(f"        subscribe: {_allow(granted.subscribe)}")
        if granted.responses is not None:
            count, expires = granted.responses
            window = f", expires: {_quote(expires)}" if expires else ""
            lines.append(f"        allow_responses: {{ max: {count}{window} }}")
        lines.append("      }")
        lines.append("    }")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return json.dumps(text)


def _value(password: str) -> str:
    """A password as the config says it: ``$NAME`` (from the server's
    environment) stays a variable reference, anything else is a string."""
    if re.fullmatch(r"\$[A-Za-z_][A-Za-z0-9_]*", password):
        return password
    return _quote(password)


def _allow(subjects: Sequence[str]) -> str:
    if not subjects:
        return '{ deny: [">"] }'
    listed = ",\n".join(f"          {_quote(s)}" for s in subjects)
    return "{ allow: [\n" + listed + "\n        ] }"


# -- the command ---------------------------------------------------------------------------


def add_parser(sub: Subcommands) -> None:
    """Add the ``auth`` command to ``sub``."""
    p = sub.add_parser(
        "auth",
        help="print the nats-server authorization block of a fleet (one user per role)",
    )
    p.add_argument(
        "--prefix", help="subject prefix of the fleet (default: $FLEETBUS_PREFIX or fleet)"
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--nkeys",
        action="store_true",
        help="NKEY users: make a seed per user, write it to SECRETS/<user>.nk (0600)",
    )
    how.add_argument(
        "--password-from-env",
        action="store_true",
        help="passwords the server reads from its environment ($FLEETBUS_PASSWORD_<USER>); "
        "nothing is written",
    )
    p.add_argument(
        "--secrets",
        type=Path,
        metavar="DIR",
        help="where generated passwords (<user>.env) or seeds go (default: ./fleetbus-auth-PREFIX)",
    )
    p.add_argument(
        "--agent",
        action="append",
        default=[],
        metavar="NAME",
        help="a user per agent, serving only that agent (repeatable; default: one agent user "
        "serving every agent)",
    )
    p.add_argument(
        "--client",
        action="append",
        default=[],
        metavar="NAME",
        help="a client user per name, each reading only its own replies (repeatable; default: one)",
    )
    p.add_argument(
        "--topic", action="append", default=[], metavar="T", help="a durable topic of the agents"
    )
    p.add_argument(
        "--sim",
        action="append",
        default=[],
        metavar="NAME",
        help="a simulation environment the agents and tools use",
    )
    p.add_argument("--out", type=Path, help="write the block to this file instead of stdout")


def cmd(args: argparse.Namespace) -> int:
    """Print (or write) the block; write the generated secrets.

    Raises:
        ConfigError: an invalid prefix or name, or a secret file that exists.
    """
    # The fleet's prefix as a connection would read it (``FLEETBUS_PREFIX``).
    prefix = ConnectOptions.from_env(prefix=args.prefix).prefix
    fleet = prefix.replace(".", "_")
    wanted: list[tuple[str, str | None]] = [("tool-worker", None)]
    wanted += [("agent", check_name(a, what="agent name")) for a in args.agent] or [("agent", None)]
    wanted.append(("model-worker", None))
    wanted += [("client", check_name(c, what="client name")) for c in args.client] or [
        ("client", None)
    ]
    wanted += [("gateway", None), ("watcher", None)]
    secrets_dir: Path = args.secrets or Path(f"fleetbus-auth-{fleet}")
    users: list[User] = []
    written: list[Path] = []
    for role, name in wanted:
        user_name = f"{fleet}-{role}" + (f"-{name}" if name else "")
        note = f"{role} {name}" if name else role
        if args.nkeys:
            pair = nkeys.from_seed(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
            seed, public = pair.seed.decode(), pair.public_key.decode()
            pair.wipe()
            seed_file = secrets_dir / f"{user_name}.nk"
            written.append(_write_secret(seed_file, seed + "\n"))
            written.append(
                _write_secret(
                    secrets_dir / f"{user_name}.env",
                    _env(prefix, FLEETBUS_NATS_NKEY=str(seed_file.resolve())),
                )
            )
            users.append(User(role=role, nkey=public, name=name, note=f"{note} ({user_name})"))
        elif args.password_from_env:
            variable = "FLEETBUS_PASSWORD_" + _ENV_NAME.sub("_", user_name.upper())
            users.append(
                User(role=role, user=user_name, password=f"${variable}", name=name, note=note)
            )
        else:
            password = secrets.token_urlsafe(24)
            written.append(
                _write_secret(
                    secrets_dir / f"{user_name}.env",
                    _env(prefix, FLEETBUS_NATS_USER=user_name, FLEETBUS_NATS_PASSWORD=password),
                )
            )
            users.append(User(role=role, user=user_name, password=password, name=name, note=note))
    block = authorization(prefix, users, topics=args.topic, simulations=args.sim)
    if args.out is not None:
        if not args.password_from_env and not args.nkeys:
            written.append(_write_secret(args.out, block))  # it holds the passwords
        else:
            args.out.write_text(block)
        err_console.print(f"wrote the authorization block to {args.out}", highlight=False)
    else:
        print(block, end="")
    for path in written:
        if path != args.out:
            err_console.print(f"wrote {path} (0600)", highlight=False)
    if args.password_from_env:
        err_console.print(
            "set each FLEETBUS_PASSWORD_<USER> in the server's environment, and "
            "FLEETBUS_NATS_USER / FLEETBUS_NATS_PASSWORD in each process",
            highlight=False,
        )
    return 0


def _env(prefix: str, **values: str) -> str:
    lines = [f"FLEETBUS_PREFIX={prefix}", *(f"{k}={v}" for k, v in values.items())]
    return "\n".join(lines) + "\n"


def _write_secret(path: Path, text: str) -> Path:
    """Write ``text`` to a new file only its owner can read.

    Raises:
        ConfigError: the file exists or cannot be written.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists; remove it or choose another --secrets") from None
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return path
