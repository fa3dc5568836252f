"""A 3-node NATS cluster on this machine for ``bench/simulation.py --cluster 3``.

The nodes run the shipped configs ``deploy/nats-cluster/node-{1,2,3}.conf``
made fit for one machine, as ``tests/integration/cluster.py`` does: each node
gets free ports on 127.0.0.1 (client, route, monitoring) and a store directory
of its own, and the routes point at those ports; JetStream, the cluster name
and the routes between all three are run as shipped. One thing differs from
the shipped files: JetStream's ``sync_interval`` is the benchmark's
(``--sync``, a flush every second by default, as on the single server it is
compared with; the files ship ``always``).

What the benchmark reads of it: each node's pid (its CPU and RSS), store
directory (bytes on disk) and route traffic (``/routez``: the messages and
bytes the node sent to the other nodes).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from _ports import free_ports

from fleetbus.bus import find_server_binary

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = tuple(ROOT / "deploy" / "nats-cluster" / f"node-{n}.conf" for n in (1, 2, 3))


@dataclass
class Node:
    number: int
    name: str
    client_port: int
    route_port: int
    http_port: int
    store_dir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def monitor(self, path: str, timeout: float = 5.0) -> Any:
        """A monitoring endpoint's JSON (``/routez``, ``/jsz``…); ``None``
        when it does not answer 200."""
        url = f"http://127.0.0.1:{self.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return json.loads(response.read()) if response.status == 200 else None
        except (OSError, ValueError, urllib.error.HTTPError):
            return None


def _sync_value(sync: float | str) -> str:
    return "always" if sync == "always" else f"{round(float(sync) * 1000)}ms"


def _localized(template: str, node: Node, nodes: list[Node], sync: float | str) -> str:
    replacements = [
        ("listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{node.client_port}"),
        ("http: 0.0.0.0:8222", f"http: 127.0.0.1:{node.http_port}"),
        ("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{node.route_port}"),
        ('store_dir: "/data"', f'store_dir: "{node.store_dir}"'),
        ("sync_interval: always", f"sync_interval: {_sync_value(sync)}"),
        *(
            (f"nats-route://{other.name}:6222", f"nats-route://127.0.0.1:{other.route_port}")
            for other in nodes
        ),
    ]
    text = template
    for old, new in replacements:
        if text.count(old) != 1:
            raise RuntimeError(f"node {node.number}: expected {old!r} once in its config")
        text = text.replace(old, new)
    return text


class LocalCluster:
    """Three nats-servers with routes between them and JetStream, in a
    temporary directory (configs, stores, logs) removed on exit."""

    def __init__(self, sync: float | str) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="fleetbus-sim-cluster-")
        self.workdir = Path(self._tmp.name)
        texts = [path.read_text(encoding="utf-8") for path in TEMPLATES]
        ports = free_ports(3 * len(texts))
        self.nodes: list[Node] = []
        for i, text in enumerate(texts):
            match = re.search(r"^server_name:\s*(\S+)\s*$", text, re.MULTILINE)
            if match is None:
                raise RuntimeError(f"{TEMPLATES[i].name} sets no server_name")
            self.nodes.append(
                Node(
                    number=i + 1,
                    name=match[1],
                    client_port=ports[3 * i],
                    route_port=ports[3 * i + 1],
                    http_port=ports[3 * i + 2],
                    store_dir=self.workdir / f"store-{i + 1}",
                )
            )
        for node, text in zip(self.nodes, texts, strict=True):
            node.store_dir.mkdir()
            config = self.workdir / f"node-{node.number}.conf"
            config.write_text(_localized(text, node, self.nodes, sync), encoding="utf-8")

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def pids(self) -> list[int]:
        return [node.pid for node in self.nodes]

    @property
    def store_dirs(self) -> list[Path]:
        return [node.store_dir for node in self.nodes]

    def number_of(self, server_name: str | None) -> int | None:
        """The node (1-based) whose ``server_name`` is ``server_name``."""
        return next((n.number for n in self.nodes if n.name == server_name), None)

    def __enter__(self) -> Self:
        binary = find_server_binary()
        try:
            for node in self.nodes:
                config = self.workdir / f"node-{node.number}.conf"
                with (self.workdir / f"node-{node.number}.log").open("wb") as log:
                    node.proc = subprocess.Popen(
                        [str(binary), "--config", str(config)],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
            self._wait_ready(30.0)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Until every node is healthy and JetStream has a meta leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.proc is not None and node.proc.poll() is not None:
                    raise RuntimeError(f"node {node.number} exited: see {self.workdir}")
            healthy = all(node.monitor("/healthz", 1.0) is not None for node in self.nodes)
            if healthy and self.meta_leader() is not None:
                return
            time.sleep(0.05)
        raise RuntimeError(f"the cluster was not ready within {timeout:g} s")

    def meta_leader(self) -> int | None:
        """The node that leads JetStream's meta group."""
        for node in self.nodes:
            jsz = node.monitor("/jsz", 1.0)
            if isinstance(jsz, dict):
                leader = (jsz.get("meta_cluster") or {}).get("leader")
                if leader:
                    return self.number_of(str(leader))
        return None

    def routes_sent(self) -> tuple[int, int]:
        """Messages and bytes all nodes sent over their routes so far."""
        msgs = sent = 0
        for node in self.nodes:
            routez = node.monitor("/routez") or {}
            for route in routez.get("routes") or []:
                msgs += int(route.get("out_msgs", 0))
                sent += int(route.get("out_bytes", 0))
        return msgs, sent

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                node.proc.wait(30)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
        self._tmp.cleanup()
