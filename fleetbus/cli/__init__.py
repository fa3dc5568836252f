"""The ``fleetbus`` command."""

from fleetbus.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
