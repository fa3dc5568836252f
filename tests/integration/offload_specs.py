"""An agent whose tool returns 2 MB, served by ``fleetbus agent
tests.integration.offload_specs:reader``. Its scripted model calls the tool,
then reads the end of the result with ``read_offloaded`` (the reference the
cut result names), then answers ``ref=<ref> tail=<what it read>``."""

from __future__ import annotations

import re

from fleetbus.agents import Agent
from fleetbus.models import ModelRequest, ModelResponse
from fleetbus.protocol import ToolResultBlock, ToolUseBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool

SIZE = 2_000_000
END = "THE-END-OF-THE-RESULT"
BIG = "x" * (SIZE - len(END)) + END
_NOTE = re.compile(r'read_offloaded\(ref="([^"]+)", offset=(\d+)')


@tool
def big() -> str:
    """A result of 2 MB, whose last characters say where it ends."""
    return BIG


def _results(request: ModelRequest) -> list[ToolResultBlock]:
    return [b for m in request.messages for b in m.content if isinstance(b, ToolResultBlock)]


def _ref(request: ModelRequest) -> str:
    found = _NOTE.search(str(_results(request)[0].output))
    return found.group(1) if found else "no reference in the cut result"


def read_the_end(request: ModelRequest) -> ModelResponse:
    use = ToolUseBlock(
        id="t2",
        name="read_offloaded",
        input={"ref": _ref(request), "offset": SIZE - 100, "limit": 100},
    )
    return ModelResponse(content=[use])


def answer(request: ModelRequest) -> str:
    return f"ref={_ref(request)} tail={_results(request)[-1].output}"


reader = Agent(
    "reader",
    "You read long results.",
    ScriptedModel(
        [ModelResponse(content=[ToolUseBlock(id="t1", name="big", input={})]), read_the_end, answer]
    ),
    toolkit=Toolkit([big]),
)
