"""Message and call ids (``new_id``): random, unique, made from random bytes
read ahead, and never repeated by a forked child."""

from __future__ import annotations

import os
import re
import sys

import pytest

from fleetbus.protocol import new_id


def test_ids_read_ahead_look_alike_and_do_not_repeat() -> None:
    ids = [new_id() for _ in range(5000)]  # many reads of random bytes ahead
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert len(new_id()) == len(ids[0])


@pytest.mark.skipif(sys.platform == "win32", reason="no fork")
def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    new_id()  # ids are read ahead now
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.write(write_end, new_id().encode())
        finally:
            os._exit(0)
    os.close(write_end)
    child_id = os.read(read_end, 64).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    assert re.fullmatch(r"[0-9a-f]{32}", child_id)
    parent_ids = {new_id() for _ in range(300)}  # more than one read ahead
    assert child_id not in parent_ids
