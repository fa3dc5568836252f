"""Ids of the messages on the tool-call path: as random and as unique as
``new_id``'s, from random bytes read ahead, and never repeated by a forked
child."""

from __future__ import annotations

import os
import re
import sys

import pytest

from fleetbus.protocol import new_id
from fleetbus.protocol.codec import fresh_id


def test_fresh_ids_look_like_new_ids_and_do_not_repeat() -> None:
    ids = [fresh_id() for _ in range(5000)]  # many reads of random bytes ahead
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert len(new_id()) == len(ids[0])


@pytest.mark.skipif(sys.platform == "win32", reason="no fork")
def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    fresh_id()  # ids are read ahead now
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.write(write_end, fresh_id().encode())
        finally:
            os._exit(0)
    os.close(write_end)
    child_id = os.read(read_end, 64).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    assert re.fullmatch(r"[0-9a-f]{32}", child_id)
    parent_ids = {fresh_id() for _ in range(300)}  # more than one read ahead
    assert child_id not in parent_ids
