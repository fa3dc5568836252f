"""``python -m fleetbus``: the same as the ``fleetbus`` command."""

from fleetbus.cli import main

raise SystemExit(main())
