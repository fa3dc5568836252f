"""An answer published while its requester's connection was away is not
lost: once the connection is back, the request (which asked for a receipt)
is sent again, and the agent's host answers the same request from where it
is — with the answer it stored, or from the reply still running — instead
of running it again.

The requester reaches the server through a proxy that cuts it off (its
connections closed, new ones refused) and lets it back.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.msg import Msg

from fleetbus.agents import Agent
from fleetbus.agents.serving import RemoteAgent
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.models import ModelRequest, ModelResponse
from fleetbus.protocol import FinalAnswer, ToolResultBlock, UserRequest, decode, encode
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from tests.helpers import CutProxy, serving

WAIT = 30.0


class Gate:
    """The tool ``gated``: it waits until opened; its runs are counted."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.opened = asyncio.Event()
        self.runs = 0

    def toolkit(self) -> Toolkit:
        @tool
        async def gated() -> str:
            """Wait for the gate."""
            self.runs += 1
            self.started.set()
            await self.opened.wait()
            return "through"

        return Toolkit([gated])


def think(request: ModelRequest) -> ModelResponse:
    """Call the tool once, then answer with its result."""
    if any(isinstance(block, ToolResultBlock) for m in request.messages for block in m.content):
        return ScriptedModel.text("got through")
    return ScriptedModel.call("gated", {}, call_id="g1")


@pytest.mark.parametrize("answered", ["while away", "once back"])
async def test_a_request_sent_again_after_a_reconnection_is_answered_once(
    nats_server: EmbeddedServer, prefix: str, answered: str
) -> None:
    gate = Gate()
    agent = Agent("waiter", "", ScriptedModel([think], repeat_last=True), toolkit=gate.toolkit())
    host, port = nats_server.url.removeprefix("nats://").split(":")
    finals: asyncio.Queue[str] = asyncio.Queue()
    async with CutProxy(host, int(port)) as proxy, serving(nats_server.url, prefix, agent):
        requester = await Bus.connect(proxy.url, prefix=prefix, name="requester")
        watcher = await Bus.connect(nats_server.url, prefix=prefix, name="watcher")

        async def seen(msg: object) -> None:  # every final answer published, wherever to
            data = getattr(msg, "data", b"")
            if b"final_answer" in data and isinstance(decode(data), FinalAnswer):
                finals.put_nowait(getattr(msg, "subject", ""))

        await watcher.nc.subscribe(">", cb=seen)
        await watcher.flush()
        try:
            asking = asyncio.create_task(
                RemoteAgent(requester, "waiter", session_id="s1").reply("go", timeout=WAIT)
            )
            async with asyncio.timeout(WAIT):
                await gate.started.wait()  # taken (its receipt sent), the tool running
            proxy.cut()
            async with asyncio.timeout(WAIT):
                while requester.nc.is_connected:  # noqa: ASYNC110 - no event for it
                    await asyncio.sleep(0.01)
            if answered == "while away":
                gate.opened.set()
                async with asyncio.timeout(WAIT):
                    await finals.get()  # lost to the requester
                proxy.restore()
            else:  # sent again while the reply runs: the same request, taken once
                proxy.restore()
                async with asyncio.timeout(WAIT):
                    while requester.reconnects.count == 0:  # noqa: ASYNC110
                        await asyncio.sleep(0.01)
                gate.opened.set()
            answer = await asyncio.wait_for(asking, WAIT)
        finally:
            await requester.close()
            await watcher.close()
    assert answer.content == "got through"
    assert gate.runs == 1  # not run again
    assert finals.qsize() <= 1  # (the one the requester got, once back)


async def test_nobody_serving_a_request_just_after_a_reconnection_is_not_its_answer(
    nats_server: EmbeddedServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A request its responder took (receipt sent) is sent again after the
    requester's reconnection; if that copy finds nobody serving the subject
    (the responders subscribing again, after a server's restart), "no
    responders" is not its answer, and the request is sent again until a
    responder has it: the answer it lost (in a server's crash, say) comes."""
    caplog.set_level(logging.INFO, logger="fleetbus.bus._replies")
    host, port = nats_server.url.removeprefix("nats://").split(":")
    subject = f"{prefix}.svc"
    taken: asyncio.Queue[str] = asyncio.Queue()
    async with CutProxy(host, int(port)) as proxy:
        requester = await Bus.connect(proxy.url, prefix=prefix, name="requester")
        responder = await Bus.connect(nats_server.url, prefix=prefix, name="responder")
        try:

            async def take(msg: Msg) -> None:  # a receipt; the answer comes later
                await responder.receipt(msg.reply)
                taken.put_nowait(msg.reply)

            serving = await responder.nc.subscribe(subject, cb=take)
            await responder.flush()
            message = UserRequest(
                sender="t", session_id="s", content="x", call_id="c1", receipt=True
            )
            asking = asyncio.create_task(
                requester.request(subject, message, timeout=WAIT, resend=0.5)
            )
            await asyncio.wait_for(taken.get(), WAIT)
            await serving.unsubscribe()  # nobody serves it now
            await responder.flush()
            proxy.cut()
            async with asyncio.timeout(WAIT):
                while requester.nc.is_connected:  # noqa: ASYNC110 - no event for it
                    await asyncio.sleep(0.01)
            proxy.restore()
            async with asyncio.timeout(WAIT):
                while "sent again" not in caplog.text:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            await requester.flush()  # the server's "no responders" to the copy is in
            assert not asking.done(), asking

            async def answer(msg: Msg) -> None:  # back, with the answer it had sent
                done = FinalAnswer(sender="svc", session_id="s", content="done")
                await responder.nc.publish(msg.reply, encode(done))

            await responder.nc.subscribe(subject, cb=answer)
            answered = await asyncio.wait_for(asking, WAIT)
        finally:
            await requester.close()
            await responder.close()
    assert isinstance(answered, FinalAnswer)
    assert answered.content == "done"
