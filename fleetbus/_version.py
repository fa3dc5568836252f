"""The package version, in one place (read by packaging and the service registry)."""

__version__ = "0.1.0"
