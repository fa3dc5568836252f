"""A snapshot fact made from a record and what a fact changes of it, and
the fields a fold of one keeps as written: what the next fact patches,
shared with nothing of the state."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from fleetbus.agents.messages import Msg
from fleetbus.agents.serving.facts import (
    Lease,
    SessionRecord,
    decode_fact,
    fact_meta,
    fold_facts,
    snapshot_fact,
    updated,
)
from fleetbus.agents.state import AgentState, PendingCall, ReplyState
from fleetbus.bus.journal import JournalEntry


def _record() -> SessionRecord:
    state = AgentState(agent_name="a", memory=[Msg.text_message("user", "hello")])
    return SessionRecord(
        agent="a",
        session_id="s",
        state=state,
        status="running",
        owner="replica-1",
        reply_to="_INBOX.x",
        pending_input={"type": "user_request", "content": "hello"},
    )


@pytest.mark.parametrize(
    "fact",
    [
        {},
        {"status": "done"},
        {"status": "running", "owner": "replica-2"},
        {"status": "done", "final": {"type": "final_answer", "content": "hi"}, "clear": True},
        {"rec": True},
        {"to": "_INBOX.y", "input": {"type": "user_request", "content": "again"}},
        {"created": "2026-12-01T10:00:00+00:00"},
    ],
)
def test_a_snapshot_from_a_record_and_a_facts_changes_is_the_one_from_the_changed_record(
    fact: dict[str, Any],
) -> None:
    record = _record()
    meta = fact_meta(fact)
    fields = record.state.model_dump(mode="json", exclude={"memory"})
    changed = record.model_copy(update=meta)
    made = snapshot_fact(record, record.state, fields, None, meta)
    assert orjson.dumps(made) == orjson.dumps(snapshot_fact(changed, record.state, fields))


def test_a_folded_snapshot_keeps_its_fields_as_written_apart_from_the_state() -> None:
    record = _record()
    state = record.state
    state.reply = ReplyState(
        reply_id="r",
        pending=[
            PendingCall(
                call_id="c",
                tool_name="write",
                parameters={"path": {"name": "a.txt"}},
                kind="confirm",
            )
        ],
    )
    fields = state.model_dump(mode="json", exclude={"memory"})
    data = orjson.dumps({**snapshot_fact(record, state, fields), "e": 1, "n": 1})
    entry = JournalEntry(7, data, datetime(2026, 12, 5, tzinfo=UTC))
    lease = Lease(SessionRecord(agent="a", session_id="s", state=AgentState(agent_name="a")), 0)
    fold_facts(lease, [(entry, decode_fact(data), len(data))])
    folded = lease.record.state
    assert lease.written == fields
    assert folded.model_dump(mode="json", exclude={"memory"}) == lease.written
    # A change made in place in the state is a change against what is written.
    assert folded.reply is not None
    folded.reply.pending[0].parameters["path"]["name"] = "b.txt"
    assert lease.written["reply"]["pending"][0]["parameters"]["path"]["name"] == "a.txt"
    assert [m.text for m in folded.memory] == ["hello"]
    assert lease.record.seq == 7
    assert lease.record.owner == "replica-1"
    assert lease.record.status == "running"


def test_a_record_updated_is_the_copy_pydantic_makes() -> None:
    record = _record()
    update = {"status": "done", "owner": None, "seq": 7, "messages": 1}

    copy = updated(record, update)

    assert copy == record.model_copy(update=update)
    assert copy.model_fields_set == record.model_copy(update=update).model_fields_set
    assert copy.model_dump() == {**record.model_dump(), **update}
    assert (record.status, record.owner, record.seq) == ("running", "replica-1", 0)  # untouched
    assert copy.state is record.state  # shallow, as model_copy is
