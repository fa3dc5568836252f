"""``fleetbus agent SPEC --replicas N``: N child processes each serving the
spec, a crashed one restarted (with a replica id of its own)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

from fleetbus.cli._common import (
    child_environment,
    console,
    err_console,
    model_option_args,
    model_options,
)

__all__ = ["supervise"]


def supervise(args: argparse.Namespace) -> int:
    """Run ``--replicas`` child processes; restart one that crashes."""
    base = [sys.executable, "-m", "fleetbus", *_child_args(args)]
    stopping = False
    children: dict[int, subprocess.Popen[bytes]] = {}
    starts: dict[int, int] = {}

    def start(index: int) -> None:
        # A restarted replica has an id of its own: one that took its dead
        # predecessor's id would take the sessions it left for its own.
        starts[index] = starts.get(index, 0) + 1
        again = f"-{starts[index]}" if starts[index] > 1 else ""
        replica = f"r{index}-{os.getpid()}{again}"
        children[index] = subprocess.Popen(
            [*base, "--replica-id", replica], env=child_environment()
        )

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for index in range(1, args.replicas + 1):
        start(index)
    console.print(f"supervising {args.replicas} replicas of {args.spec}")
    while True:
        for index, child in list(children.items()):
            code = child.poll()
            if code is None or stopping:
                continue
            err_console.print(f"[yellow]replica {index} exited with {code}; restarting[/]")
            time.sleep(1.0)
            start(index)
        if stopping:
            for child in children.values():
                try:
                    child.wait(60)
                except subprocess.TimeoutExpired:
                    child.kill()
            return 0
        time.sleep(0.2)


def _child_args(args: argparse.Namespace) -> list[str]:
    out = ["agent", args.spec, "--replicas", "1", "--lease-ttl", str(args.lease_ttl)]
    for topic in args.topic:
        out += ["--topic", topic]
    if args.group:
        out += ["--group", args.group]
    if args.durable_topics:
        out.append("--durable-topics")
    if args.concurrency:
        out += ["--concurrency", str(args.concurrency)]
    if args.events != "all":
        out += ["--events", args.events]
    if args.checkpoints != "step":
        out += ["--checkpoints", args.checkpoints]
    if args.no_remote_tools:
        out.append("--no-remote-tools")
    if args.model is not None:
        out += ["--model", args.model]
    out += model_option_args(model_options(args))
    if args.nats:
        out += ["--nats", args.nats]
    if args.prefix:
        out += ["--prefix", args.prefix]
    return out
