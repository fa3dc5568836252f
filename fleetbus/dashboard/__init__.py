"""``fleetbus dashboard``: a live web page of a fleet, read from the bus only.

:class:`FleetView` follows the fleet (session store, event streams, lease
writes, ``$SRV.STATS``) within fixed memory bounds; :func:`create_app` serves
it as one HTML page with Server-Sent Events (Starlette, from the
``fleetbus[dashboard]`` extra). See docs/dashboard.md.
"""

from fleetbus.dashboard._confirm import ConfirmOutcome
from fleetbus.dashboard.app import DEFAULT_HOSTS, STATIC_DIR, TOKEN_HEADER, create_app
from fleetbus.dashboard.view import FleetView, Limits

__all__ = [
    "DEFAULT_HOSTS",
    "STATIC_DIR",
    "TOKEN_HEADER",
    "ConfirmOutcome",
    "FleetView",
    "Limits",
    "create_app",
]
