"""The tools of a long-term memory worker, which no model is offered.

A memory worker (``fleetbus worker fleetbus.tools_workers.memory``) serves
them to the memory's client (:class:`fleetbus.capabilities.BusMemory`); they
read and write any agent's and any user's memory, so the loop never offers
them to a model, even when an agent's toolkit has every tool of the bus. The
long-term memory itself is a capability: :mod:`fleetbus.capabilities.memory`.
"""

from __future__ import annotations

from typing import Final

__all__ = ["STORE_RECORD_TOOL", "STORE_RETRIEVE_TOOL", "STORE_TOOLS"]

STORE_RECORD_TOOL: Final = "long_term_memory_record"
"""The memory worker's tool that records texts."""
STORE_RETRIEVE_TOOL: Final = "long_term_memory_retrieve"
"""The memory worker's tool that searches them."""
STORE_TOOLS: Final = frozenset({STORE_RECORD_TOOL, STORE_RETRIEVE_TOOL})
"""The tools of the memory worker: no model is offered them."""
