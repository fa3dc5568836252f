"""The public surface: complete, sorted, importable."""

from __future__ import annotations

import importlib

import pytest

import fleetbus


def _isort_key(name: str) -> tuple[int, str]:
    """Constants, then classes, then functions (the order ruff's RUF022 keeps)."""
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return kind, name


@pytest.mark.parametrize(
    "module",
    [
        "fleetbus",
        "fleetbus.protocol",
        "fleetbus.bus",
        "fleetbus.tools_workers",
        "fleetbus.models",
        "fleetbus.agents",
        "fleetbus.capabilities",
        "fleetbus.errors",
        "fleetbus.sim",
        "fleetbus.evals",
    ],
)
def test_all_is_sorted_and_every_name_exists(module: str) -> None:
    mod = importlib.import_module(module)
    names = list(mod.__all__)
    assert names == sorted(names, key=_isort_key), f"{module}.__all__ is not sorted"
    for name in names:
        assert hasattr(mod, name), f"{module}.{name} is in __all__ but missing"


def test_top_level_exports_the_names_users_type() -> None:
    for name in ("Bus", "EmbeddedServer", "ToolWorker", "Toolkit", "tool", "FleetbusError"):
        assert name in fleetbus.__all__
    public = {
        n
        for n in vars(fleetbus)
        if not n.startswith("_")
        and n
        not in {
            "bus",
            "protocol",
            "tools_workers",
            "errors",
            "cli",
            "models",
            "agents",
            "capabilities",
            "testing",
            "sim",
            "evals",
            "logs",
            "tracing",
            "dashboard",
            "gateway",
        }
    }
    assert public <= set(fleetbus.__all__), public - set(fleetbus.__all__)


def test_the_protocol_package_does_no_io() -> None:
    """protocol imports nothing of ours but itself, and no transport."""
    import ast
    from pathlib import Path

    root = Path(fleetbus.__file__).parent / "protocol"
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(("nats", "asyncio")), path
                if node.module.startswith("fleetbus"):
                    assert node.module.startswith(("fleetbus.protocol", "fleetbus.errors")), path
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] not in {"nats", "asyncio", "socket"}, path


def test_models_never_import_agents() -> None:
    """The dependency runs one way: agents may import models, never back."""
    import ast
    from pathlib import Path

    root = Path(fleetbus.__file__).parent / "models"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("fleetbus.agents"), path
