"""``fleetbus gateway``: the agents of a fleet over HTTP (docs/gateway.md).

- an OpenAI-compatible API (``/v1/models``, ``/v1/chat/completions``,
  ``/v1/responses``), ``model`` naming an agent;
- the fleet's own REST API with Server-Sent Events (``/v1/fleet/…``);
- A2A: an agent card and a JSON-RPC endpoint per agent (``/a2a/{agent}``).

Stateless: any number of replicas serve one fleet, everything they know is
on the bus. Needs the ``gateway`` extra (FastAPI, uvicorn, a2a-sdk).
"""

from fleetbus.gateway.app import create_app
from fleetbus.gateway.auth import Caller, Tokens, new_token
from fleetbus.gateway.fleet import GatewayFleet
from fleetbus.gateway.settings import GatewaySettings, gateway_settings

__all__ = [
    "Caller",
    "GatewayFleet",
    "GatewaySettings",
    "Tokens",
    "create_app",
    "gateway_settings",
    "new_token",
]
