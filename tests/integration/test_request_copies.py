"""A copy of a request (sent again by a client that had no receipt) that
reaches a replica while another holds the session's lease serving that very
request is not queued behind it: the holder answers the copy's reply
subject, which is the request's."""

from __future__ import annotations

import pytest

from fleetbus.agents.serving.sessions import SessionStore, session_key
from fleetbus.agents.state import AgentState
from fleetbus.bus import Bus
from fleetbus.errors import RequestHeldError, SessionBusyError
from fleetbus.protocol import UserRequest, to_builtins


@pytest.mark.parametrize("size", [2, 40_000], ids=["carried", "too-large-to-carry"])
async def test_a_copy_of_the_request_a_lease_serves_is_not_queued(bus: Bus, size: int) -> None:
    """A request too large to ride in the lease value is known there by its
    call_id: its copies are not queued either."""
    holder = await SessionStore.open(bus, owner="a")
    other = await SessionStore.open(bus, owner="b")
    request = UserRequest(content="hi" * (size // 2), session_id="s1", call_id="q-1", receipt=True)
    lease = await holder.acquire(
        "ann",
        "s1",
        fresh=AgentState(agent_name="ann"),
        reply_to="_INBOX.x.1",
        pending_input=to_builtins(request),
    )
    # The same request to the same reply subject: held, at once (no wait).
    with pytest.raises(RequestHeldError):
        await other.acquire("ann", "s1", wait=30, joins=("q-1", "_INBOX.x.1"))
    # Another request, or the same call_id to another reply subject (a new
    # attempt by a client that asked again): it waits for the session.
    for joins in (("q-2", "_INBOX.x.1"), ("q-1", "_INBOX.y.1"), None):
        with pytest.raises(SessionBusyError) as caught:
            await other.acquire("ann", "s1", wait=0.3, joins=joins)
        assert not isinstance(caught.value, RequestHeldError)
    await holder.release(lease)


async def test_a_copy_of_a_request_a_take_over_serves_is_known_from_its_first_renewal(
    bus: Bus,
) -> None:
    dead = await SessionStore.open(bus, owner="a")
    heir = await SessionStore.open(bus, owner="b")
    other = await SessionStore.open(bus, owner="c")
    request = UserRequest(content="hi", session_id="s2", call_id="q-7", receipt=True)
    await dead.acquire(
        "ann",
        "s2",
        fresh=AgentState(agent_name="ann"),
        reply_to="_INBOX.z.7",
        pending_input=to_builtins(request),
    )  # ...and its replica dies holding it
    silent = await heir.leases.get(session_key("ann", "s2"))
    lease = await heir.acquire("ann", "s2", take_over=True, lease_revision=silent.revision)
    await heir.renew(lease)
    with pytest.raises(RequestHeldError):
        await other.acquire("ann", "s2", wait=30, joins=("q-7", "_INBOX.z.7"))
    await heir.release(lease)
