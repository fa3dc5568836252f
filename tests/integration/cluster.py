"""A real 3-node NATS cluster for tests, started from the shipped configs.

``deploy/nats-cluster/node-{1,2,3}.conf`` are made fit for one machine: each
node gets free ports on 127.0.0.1 (client, route, monitoring) and a store
directory of its own; the rest — JetStream, ``sync_interval: always``, the
cluster name, the routes between all three — is run as shipped, so every test
that uses the cluster also tests those files. A rewrite that finds the file
changed fails loudly instead of starting something else.

Use it from a fixture::

    cluster = NatsCluster(tmp_path).start()   # returns once JetStream has a meta leader
    bus = await Bus.connect(cluster.urls)
    leader = await cluster.stream_leader(bus, "fleet_session")
    cluster.kill(leader)                      # SIGKILL, as a crash would
    cluster.restart(leader)                   # same config, same store
    await asyncio.to_thread(cluster.wait_ready)
    cluster.stop()

Nodes are numbered 1 to 3, as the config files are. The waits are blocking
(they poll the monitoring port); call them through ``asyncio.to_thread`` from
async code that has other work in flight.

``NatsCluster(tmp_path, apart=Apart(netns, near, far))`` runs node 3 in the
network namespace ``netns``, reached at ``far`` over a veth pair whose end on
this side has ``near``: setting that link down cuts node 3 off from the other
two and from every client outside, while it keeps running.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import nats.errors
import nats.js.errors

from fleetbus.bus import Bus, find_server_binary

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "nats-cluster"
TEMPLATES = tuple(DEPLOY / f"node-{n}.conf" for n in (1, 2, 3))

CLIENT_PORT = 4222
ROUTE_PORT = 6222
HTTP_PORT = 8222
STORE_DIR = "/data"


class ClusterError(AssertionError):
    """The cluster did not start, or did not become ready in time."""


@dataclass(frozen=True)
class Apart:
    """Where node 3 runs apart: a network namespace, the address this side
    has on the link to it, and its address on that link."""

    netns: str
    near: str
    far: str


@dataclass
class Node:
    """One nats-server of the cluster."""

    number: int
    name: str
    """``server_name`` from its config: what stream info calls it."""
    template: Path
    client_port: int
    route_port: int
    http_port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    host: str = "127.0.0.1"
    """Where clients and the other nodes reach it."""
    netns: str | None = None
    """The network namespace it runs in (``None``: this one)."""

    @property
    def url(self) -> str:
        """Its client URL."""
        return f"nats://{self.host}:{self.client_port}"

    def monitoring(self, path: str) -> str:
        """The URL of one of its monitoring endpoints."""
        return f"http://{self.host}:{self.http_port}{path}"

    @property
    def config(self) -> Path:
        """The rewritten config it runs."""
        return self.workdir / f"node-{self.number}.conf"

    @property
    def store_dir(self) -> Path:
        """Its JetStream store."""
        return self.workdir / f"store-{self.number}"

    @property
    def log(self) -> Path:
        """Where its output goes."""
        return self.workdir / f"node-{self.number}.log"

    @property
    def running(self) -> bool:
        """Whether its process is alive."""
        return self.proc is not None and self.proc.poll() is None


def server_name(template: str) -> str:
    """The ``server_name`` a config file sets."""
    match = re.search(r"^server_name:\s*(\S+)\s*$", template, re.MULTILINE)
    if match is None:
        raise ClusterError("the config sets no server_name")
    return match[1]


def localize(template: str, node: Node, nodes: Sequence[Node], apart: Apart | None = None) -> str:
    """A shipped node config, with this machine's ports and store directory
    (and, with ``apart``, addresses that reach across the namespaces).

    Raises:
        ClusterError: the file no longer has what the rewrite replaces.
    """
    # With a node apart, routes and clients come from inside its namespace
    # too: to this side's address.
    bind = "0.0.0.0" if apart is not None else "127.0.0.1"

    def route_host(other: Node) -> str:
        return apart.near if apart is not None and node.netns and not other.netns else other.host

    replacements = [
        (f"listen: 0.0.0.0:{CLIENT_PORT}", f"listen: {bind}:{node.client_port}"),
        (f"http: 0.0.0.0:{HTTP_PORT}", f"http: {bind}:{node.http_port}"),
        (f"listen: 0.0.0.0:{ROUTE_PORT}", f"listen: {bind}:{node.route_port}"),
        (f'store_dir: "{STORE_DIR}"', f'store_dir: "{node.store_dir}"'),
        *(
            (
                f"nats-route://{other.name}:{ROUTE_PORT}",
                f"nats-route://{route_host(other)}:{other.route_port}",
            )
            for other in nodes
        ),
    ]
    text = template
    for old, new in replacements:
        if text.count(old) != 1:
            raise ClusterError(f"{node.template.name}: expected {old!r} once in the config")
        text = text.replace(old, new)
    return text


def free_ports(count: int) -> list[int]:
    """Ports nothing listens on now (all held at once, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


async def stream_info(bus: Bus, stream: str, timeout: float = 10.0) -> dict[str, Any]:
    """A stream's info as JetStream's API answers it (raw JSON: ``config``,
    ``cluster.leader``, ``cluster.replicas``…).

    Raises:
        ClusterError: the API answered with an error.
    """
    reply = await bus.nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=timeout)
    info = json.loads(reply.data)
    if not isinstance(info, dict) or "error" in info:
        raise ClusterError(f"stream info {stream}: {info}")
    return info


async def stream_message(bus: Bus, stream: str, seq: int, timeout: float = 2.0) -> bytes | None:
    """The payload of message ``seq`` of a stream (a KV revision), or ``None``
    when the stream does not have it.

    Raises:
        ClusterError: the API answered with another error.
    """
    request = json.dumps({"seq": seq}).encode()
    reply = await bus.nc.request(f"$JS.API.STREAM.MSG.GET.{stream}", request, timeout=timeout)
    answer = json.loads(reply.data)
    error = answer.get("error")
    if error is not None:
        if error.get("code") == 404:
            return None
        raise ClusterError(f"message {seq} of {stream}: {error}")
    return base64.b64decode(answer["message"].get("data", ""))


def _get_json(url: str, timeout: float = 1.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return 0, None


class NatsCluster:
    """Three nats-server processes with routes between them and JetStream.

    Args:
        workdir: where the configs, stores and logs go.
        templates: the node configs to run (the shipped ones by default).
        binary: the nats-server executable; found as fleetbus finds it when
            ``None``.
        apart: run node 3 in this network namespace (see :class:`Apart`).
    """

    def __init__(
        self,
        workdir: Path,
        *,
        templates: Sequence[Path] = TEMPLATES,
        binary: Path | None = None,
        apart: Apart | None = None,
    ) -> None:
        self.workdir = workdir
        self.binary = binary or find_server_binary()
        texts = [path.read_text(encoding="utf-8") for path in templates]
        ports = free_ports(3 * len(texts))
        self.nodes = [
            Node(
                number=i + 1,
                name=server_name(text),
                template=path,
                client_port=ports[3 * i],
                route_port=ports[3 * i + 1],
                http_port=ports[3 * i + 2],
                workdir=workdir,
            )
            for i, (path, text) in enumerate(zip(templates, texts, strict=True))
        ]
        if len({node.name for node in self.nodes}) != len(self.nodes):
            raise ClusterError("two node configs set the same server_name")
        if apart is not None:
            self.nodes[2].netns, self.nodes[2].host = apart.netns, apart.far
        for node, text in zip(self.nodes, texts, strict=True):
            node.store_dir.mkdir(parents=True, exist_ok=True)
            node.config.write_text(localize(text, node, self.nodes, apart), encoding="utf-8")

    @property
    def urls(self) -> list[str]:
        """Every node's client URL."""
        return [node.url for node in self.nodes]

    def node(self, number: int) -> Node:
        """Node ``number`` (1-based)."""
        return self.nodes[number - 1]

    def number_of(self, name: str) -> int:
        """The node whose ``server_name`` is ``name``."""
        for node in self.nodes:
            if node.name == name:
                return node.number
        raise ClusterError(f"no node is called {name!r}")

    def start(self, timeout: float = 30.0) -> Self:
        """Start every node; return once each is healthy and JetStream has a
        meta leader.

        Raises:
            ClusterError: a node exited, or the cluster was not ready in time.
        """
        try:
            for node in self.nodes:
                self._spawn(node)
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, node: Node) -> None:
        if node.running:
            raise ClusterError(f"node {node.number} is already running")
        with node.log.open("ab") as log:
            inside = ["ip", "netns", "exec", node.netns] if node.netns else []
            node.proc = subprocess.Popen(
                [*inside, str(self.binary), "--config", str(node.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self, number: int) -> None:
        """SIGKILL node ``number``, as a crash would; its store stays."""
        node = self.node(number)
        proc, node.proc = node.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def restart(self, number: int) -> None:
        """Start node ``number`` again, with its config and store (no wait:
        see :meth:`wait_ready`)."""
        self._spawn(self.node(number))

    def restart_stopped(self) -> list[int]:
        """Start every node that is not running; the ones started."""
        started = [node.number for node in self.nodes if not node.running]
        for number in started:
            self.restart(number)
        return started

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until every running node is healthy (``/healthz``: it knows the
        JetStream meta leader and is current) and a meta leader is elected.

        Raises:
            ClusterError: a node exited, or not ready within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            for node in self.nodes:
                if node.proc is not None and node.proc.poll() is not None:
                    raise ClusterError(f"node {node.number} exited:\n{self.log_tail(node)}")
            waiting = [
                node.number
                for node in self.nodes
                if node.running and _get_json(node.monitoring("/healthz"))[0] != 200
            ]
            if not waiting and self.meta_leader() is not None and self._peers_current():
                return
            if time.monotonic() > deadline:
                logs = "\n".join(self.log_tail(self.node(n)) for n in waiting)
                raise ClusterError(f"nodes {waiting} not ready within {timeout:g}s\n{logs}")
            time.sleep(0.05)

    def _peers_current(self) -> bool:
        """Whether the meta leader sees every other running node as current:
        until it does, a restarted node is a peer offline to it, and a stream
        wanting three copies finds "no suitable peers for placement"."""
        leader = self.meta_leader()
        nodes = [node for node in self.nodes if node.name == leader and node.running]
        if not nodes:
            return False
        status, jsz = _get_json(nodes[0].monitoring("/jsz"))
        if status != 200 or not isinstance(jsz, dict):
            return False
        seen = {
            peer.get("name"): bool(peer.get("current")) and not peer.get("offline")
            for peer in (jsz.get("meta_cluster") or {}).get("replicas") or []
        }
        others = [node.name for node in self.nodes if node.running and node.name != leader]
        return all(seen.get(name) for name in others)

    async def wait_placement(self, bus: Bus, timeout: float = 30.0) -> None:
        """Wait until the cluster places a stream on every running node. The
        meta leader may see a restarted node as current (``wait_ready``)
        before its placement does: until then a stream wanting three copies
        finds "no suitable peers for placement, peer offline". A stream of
        as many copies as nodes run is made, then deleted.

        Raises:
            ClusterError: not placed within ``timeout`` seconds.
        """
        js = bus.nc.jetstream(timeout=5.0)
        name = f"placement_probe_{time.monotonic_ns()}"
        replicas = sum(1 for node in self.nodes if node.running)
        deadline = time.monotonic() + timeout
        while True:
            try:
                await js.add_stream(
                    name=name, subjects=[f"{name}.>"], num_replicas=replicas, storage="memory"
                )
                break
            except nats.js.errors.BadRequestError as exc:
                if "no suitable peers" not in str(exc) or time.monotonic() > deadline:
                    raise ClusterError(f"no stream of {replicas} copies placed: {exc}") from exc
                await asyncio.sleep(0.1)
            except nats.errors.TimeoutError as exc:
                # A busy machine's fresh cluster can be slow to answer; the
                # stream may be made all the same, and asking again for the
                # same one answers it.
                if time.monotonic() > deadline:
                    raise ClusterError(f"no stream of {replicas} copies placed: {exc}") from exc
        await js.delete_stream(name)

    def meta_leader(self) -> str | None:
        """The server name of the JetStream meta leader, as a running node sees it."""
        for node in self.nodes:
            if not node.running:
                continue
            status, jsz = _get_json(node.monitoring("/jsz"))
            if status == 200 and isinstance(jsz, dict):
                leader = (jsz.get("meta_cluster") or {}).get("leader")
                if leader:
                    return str(leader)
        return None

    def client_addresses(self, number: int) -> set[str]:
        """The addresses node ``number``'s clients connect from now (``/connz``)."""
        status, connz = _get_json(self.node(number).monitoring("/connz"))
        if status != 200 or not isinstance(connz, dict):
            raise ClusterError(f"node {number}: /connz answered {status}")
        return {str(c.get("ip")) for c in connz.get("connections") or []}

    def route_names(self, number: int) -> set[str]:
        """The servers node ``number`` has a route to now (``/routez``)."""
        status, routez = _get_json(self.node(number).monitoring("/routez"))
        if status != 200 or not isinstance(routez, dict):
            raise ClusterError(f"node {number}: /routez answered {status}")
        return {str(r.get("remote_name")) for r in routez.get("routes") or []}

    def varz(self, number: int) -> dict[str, Any]:
        """Node ``number``'s ``/varz`` (its running configuration)."""
        status, varz = _get_json(self.node(number).monitoring("/varz"))
        if status != 200 or not isinstance(varz, dict):
            raise ClusterError(f"node {number}: /varz answered {status}")
        return varz

    async def stream_leader(
        self, bus: Bus, stream: str, *, exclude: int | None = None, timeout: float = 20.0
    ) -> int:
        """The node that leads ``stream`` (other than ``exclude``), once one does.

        Raises:
            ClusterError: no such leader within ``timeout`` seconds.
        """
        deadline = asyncio.get_running_loop().time() + timeout
        last: object = None
        while asyncio.get_running_loop().time() < deadline:
            try:
                info = await stream_info(bus, stream, timeout=2.0)  # asked again if need be
            except Exception as exc:  # no leader yet, or the connection is failing over
                last = exc
            else:
                leader = (info.get("cluster") or {}).get("leader")
                last = leader
                if leader and self.number_of(str(leader)) != exclude:
                    return self.number_of(str(leader))
            await asyncio.sleep(0.1)
        raise ClusterError(f"stream {stream} has no leader within {timeout:g}s (last: {last})")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every node: SIGTERM, then SIGKILL after ``timeout`` seconds."""
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                node.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()
            node.proc = None

    def log_tail(self, node: Node, lines: int = 15) -> str:
        """The end of a node's log."""
        try:
            text = node.log.read_text(errors="replace")
        except OSError:
            return f"node {node.number}: (no log)"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"-- node {node.number} ({node.name}) --\n{tail}"
