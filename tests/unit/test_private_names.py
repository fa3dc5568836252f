"""The contract of the guarded seams: no module of fleetbus reads or writes
a private name of nats-py, asyncio or OpenTelemetry except the one seam of
each (``fleetbus/bus/_seam.py`` for nats-py and asyncio, ``fleetbus/tracing.py``
for OpenTelemetry), and nothing outside ``fleetbus.bus`` holds the raw NATS
client (``Bus.nc``).

A private name is one a library's own source defines with a leading
underscore (a function, a class, an attribute it assigns, a module global).
Names that fleetbus's own classes define too (``self._state = …``) are
fleetbus's, since the source alone does not say whose object ``x._state`` is;
``self._x`` and ``cls._x`` are always the class's own."""

from __future__ import annotations

import ast
import importlib
from functools import cache
from pathlib import Path

FLEETBUS = Path(__file__).resolve().parents[2] / "fleetbus"
LIBRARIES = ("nats", "asyncio", "opentelemetry")
SEAMS = {"bus/_seam.py", "tracing.py"}
"""The modules allowed to reach into the libraries' private names."""


def _defined_private_names(files: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


def _sources(package: str) -> list[Path]:
    module = importlib.import_module(package)
    roots = [Path(p) for p in getattr(module, "__path__", [])]
    return [f for root in roots for f in root.rglob("*.py")]


@cache
def library_private_names() -> frozenset[str]:
    """Private names the libraries define and fleetbus's own code does not."""
    theirs = set().union(*(_defined_private_names(_sources(lib)) for lib in LIBRARIES))
    ours = _defined_private_names(list(FLEETBUS.rglob("*.py")))
    return frozenset(theirs - ours)


def private_accesses(source: str, private: frozenset[str]) -> list[str]:
    """Where ``source`` reads or writes one of ``private`` on an object not
    its own (not ``self``/``cls``), by attribute or by ``getattr``-like call."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in private:
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in private
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in LIBRARIES
        ):
            found.extend(
                f"{node.lineno}: from {node.module} import {alias.name}"
                for alias in node.names
                if alias.name in private
            )
    return found


def _modules() -> list[tuple[str, str]]:
    return [
        (path.relative_to(FLEETBUS).as_posix(), path.read_text(encoding="utf-8"))
        for path in sorted(FLEETBUS.rglob("*.py"))
    ]


def test_no_module_but_a_seam_touches_a_librarys_private_names() -> None:
    private = library_private_names()
    found = {
        name: hits
        for name, source in _modules()
        if name not in SEAMS and (hits := private_accesses(source, private))
    }
    assert found == {}


def test_the_check_finds_what_the_seam_does() -> None:
    """The seam itself reaches into nats-py and asyncio: the check sees it
    (a check that finds nothing anywhere proves nothing)."""
    source = (FLEETBUS / "bus/_seam.py").read_text(encoding="utf-8")
    hits = private_accesses(source, library_private_names())
    assert any("limiter._waiters" in hit for hit in hits)
    assert any("sub._pending_queue" in hit for hit in hits)
    assert private_accesses('getattr(kv, "_pre", None)\n', library_private_names())


def _raw_client_uses(source: str) -> list[str]:
    return [
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in ("nc", "_nc")
    ]


def test_nothing_outside_the_bus_holds_the_raw_client() -> None:
    found = {
        name: hits
        for name, source in _modules()
        if not name.startswith("bus/") and (hits := _raw_client_uses(source))
    }
    assert found == {}
