"""The container set-up, checked offline (no Docker engine needed).

``docker-compose.yml`` is a valid Compose file (the Compose Specification's JSON
Schema, as vendored by check-jsonschema) describing the fleet we mean; every
``fleetbus`` command it runs or documents is one the CLI parses; the
``Dockerfile`` copies what the package build needs, and ``.dockerignore``
keeps those files in the build context.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from ruamel.yaml import YAML

from fleetbus.bus import MIN_SERVER_VERSION
from fleetbus.bus._server_version import server_release
from fleetbus.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CLUSTER_COMPOSE = ROOT / "deploy" / "nats-cluster" / "compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PYPROJECT = ROOT / "pyproject.toml"

FLEET_SERVICES = {"nats", "tools", "agent"}
PENDING_SUBCOMMANDS = {"agent", "ask"}
"""Commands the compose file uses that land with the agent-process work."""


# -- loading ---------------------------------------------------------------------------------


@cache
def compose() -> dict[str, Any]:
    data = YAML(typ="safe", pure=True).load(COMPOSE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def services() -> dict[str, dict[str, Any]]:
    result = compose()["services"]
    assert isinstance(result, dict)
    return result


@cache
def compose_schema() -> dict[str, Any]:
    resource = files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(resource.read_text(encoding="utf-8"))
    assert isinstance(schema, dict)
    return schema


def schema_errors(document: dict[str, Any]) -> list[str]:
    schema = compose_schema()
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
        for error in validator.iter_errors(document)
    ]


@cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str


def dockerfile_stages() -> list[list[Instruction]]:
    """The Dockerfile's instructions, one list per stage (continuations joined)."""
    stages: list[list[Instruction]] = []
    logical = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not logical and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        keyword, _, arguments = logical.partition(" ")
        logical = ""
        instruction = Instruction(keyword.upper(), arguments.strip())
        if instruction.keyword == "FROM":
            stages.append([])
        assert stages, "a Dockerfile starts with FROM"
        stages[-1].append(instruction)
    assert not logical, "the Dockerfile ends inside a continued line"
    return stages


def exec_form(instruction: Instruction) -> list[str]:
    value = json.loads(instruction.arguments)
    assert isinstance(value, list), f"{instruction.keyword} must use the JSON (exec) form"
    assert all(isinstance(item, str) for item in value)
    return value


def copy_sources(instruction: Instruction) -> list[str]:
    """The context paths a COPY takes (none when it copies from another stage)."""
    words = shlex.split(instruction.arguments)
    if any(word.startswith("--from") for word in words):
        return []
    paths = [word for word in words if not word.startswith("--")]
    return [path.rstrip("/") or "." for path in paths[:-1]]


def covered(path: str, sources: list[str]) -> bool:
    return any(path == source or path.startswith(source + "/") for source in sources)


def build_inputs() -> set[str]:
    """What building the package reads, according to pyproject.toml."""
    project = pyproject()
    hatch = project["tool"]["hatch"]
    readme = project["project"]["readme"]
    return {
        "pyproject.toml",
        readme if isinstance(readme, str) else readme["file"],
        hatch["version"]["path"],
        *hatch["build"]["targets"]["wheel"]["packages"],
    }


def dockerignore_excludes(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` out of the build context (Docker's rules:
    patterns match from the context root, a match on a parent directory excludes
    what is under it, ``**`` spans directories, the last matching pattern wins)."""
    excluded = False
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        if any(_dockerignore_regex(pattern).fullmatch(c) for c in candidates):
            excluded = not negated
    return excluded


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out += pattern[i : end + 1]
            i = end + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


# -- fleetbus commands -----------------------------------------------------------------------


def fleetbus_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every fleetbus command: the commands of services built from
    this project, and the ``docker compose run --rm SERVICE …`` lines in the header."""
    commands: list[tuple[str, list[str]]] = []
    for name, service in services().items():
        if "build" in service and "command" in service:
            command = service["command"]
            assert isinstance(command, list), f"service {name}: use the list form of command"
            commands.append((f"service {name}", [str(word) for word in command]))
    for line in COMPOSE.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        match = re.search(r"docker compose run --rm (\S+) ([^#]+)", line)
        if match:
            assert match[1] in services(), f"the header runs an unknown service: {line}"
            commands.append((f"header: {line.lstrip('# ')}", shlex.split(match[2])))
    return commands


def known_subcommands() -> set[str]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    raise AssertionError("the fleetbus parser has no subcommands")


def parse(where: str, argv: list[str]) -> argparse.Namespace:
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: 'fleetbus {shlex.join(argv)}' does not parse (exit {exc.code})")


# -- docker-compose.yml ----------------------------------------------------------------------


def test_compose_file_follows_the_compose_specification() -> None:
    assert schema_errors(compose()) == []
    assert "version" not in compose(), "the Compose Specification dropped the top-level version"


def test_the_schema_check_catches_mistakes() -> None:
    broken = copy.deepcopy(compose())
    broken["services"]["tools"]["replica"] = 2
    assert any("replica" in error for error in schema_errors(broken))


def test_the_fleet_services_are_there() -> None:
    assert set(services()) >= FLEET_SERVICES
    for name in ("tools", "agent"):
        assert services()[name]["build"] == ".", f"{name} runs the image of this project"


def test_nats_runs_jetstream_with_a_volume_and_a_healthcheck() -> None:
    nats = services()["nats"]
    # A release fleetbus supports: a tag without a patch is its newest one.
    version = re.fullmatch(r"nats:(\d+)\.(\d+)(?:\.(\d+))?-alpine", nats["image"])
    assert version is not None, nats["image"]
    minimum = server_release(MIN_SERVER_VERSION)
    assert minimum is not None
    if version[3] is None:
        assert (int(version[1]), int(version[2])) >= minimum[:2]
    else:
        assert (int(version[1]), int(version[2]), int(version[3])) >= minimum
    command = nats["command"]
    assert "-js" in command
    data_dir = command[command.index("-sd") + 1]
    assert f"nats-data:{data_dir}" in nats["volumes"]
    monitor_port = command[command.index("-m") + 1]
    test = nats["healthcheck"]["test"]
    assert test[0] == "CMD"
    assert any(f":{monitor_port}/healthz" in word for word in test)
    assert "alpine" in nats["image"], "the scratch nats image has no wget for the healthcheck"


def mounted_file(service: dict[str, Any], target: str, base: Path) -> Path:
    """The file of ``base``'s tree that ``service`` mounts at ``target``."""
    for volume in service.get("volumes", []):
        source, _, rest = volume.partition(":")
        if rest.partition(":")[0] == target:
            assert source.startswith("./"), f"{target} is not mounted from a file: {volume}"
            return base / str(source)
    raise AssertionError(f"nothing is mounted at {target}")


def test_nats_fsyncs_every_write() -> None:
    nats = services()["nats"]
    command = nats["command"]
    config = mounted_file(nats, command[command.index("-c") + 1], ROOT)
    text = config.read_text(encoding="utf-8")
    assert re.search(r"^jetstream\s*\{[^}]*^\s*sync_interval:\s*always\s*$", text, re.M | re.S)


def test_the_cluster_compose_file_runs_the_shipped_node_configs() -> None:
    data = YAML(typ="safe", pure=True).load(CLUSTER_COMPOSE.read_text(encoding="utf-8"))
    assert schema_errors(data) == []
    cluster = data["services"]
    assert set(cluster) == {"nats-1", "nats-2", "nats-3"}
    declared = set(data["volumes"])
    for name, service in cluster.items():
        assert service["image"] == services()["nats"]["image"], "one NATS version everywhere"
        command = service["command"]
        config = mounted_file(service, command[command.index("-c") + 1], CLUSTER_COMPOSE.parent)
        assert config.name == f"node-{name.removeprefix('nats-')}.conf"
        text = config.read_text(encoding="utf-8")
        assert f"server_name: {name}\n" in text
        routes = set(re.findall(r"nats-route://([^:\s]+):6222", text))
        assert routes == set(cluster), f"{config.name} routes to {routes}"
        store = re.search(r'store_dir:\s*"([^"]+)"', text)
        assert store is not None
        assert f"{name}-data:{store[1]}" in service["volumes"]
        assert f"{name}-data" in declared
        assert "http: 0.0.0.0:8222" in text
        assert any(":8222/healthz" in word for word in service["healthcheck"]["test"])
        assert "sync_interval: always" in text


def test_tool_workers_scale_and_drain() -> None:
    tools = services()["tools"]
    assert tools["deploy"]["replicas"] == 2
    assert tools["environment"]["FLEETBUS_FILES_ROOT"] == "/workspace"
    assert "workspace:/workspace" in tools["volumes"]
    assert tools["stop_signal"] == "SIGTERM"
    assert tools["depends_on"]["nats"]["condition"] == "service_healthy"
    grace = tools["stop_grace_period"]
    assert re.fullmatch(r"\d+s", grace), grace
    drain = parse("service tools", tools["command"]).drain_timeout
    assert int(grace[:-1]) >= drain, "the worker must finish draining before SIGKILL"


def test_the_agent_waits_for_the_bus_and_gets_the_model_settings() -> None:
    agent = services()["agent"]
    depends = agent["depends_on"]
    assert depends["nats"]["condition"] == "service_healthy"
    assert depends["tools"]["condition"] == "service_started"
    environment = agent["environment"]
    names = {item.partition("=")[0] for item in environment}
    assert {"OPENAI_API_KEY", "OPENAI_BASE_URL", "FLEETBUS_MODEL"} <= names
    assert all("=" not in item for item in environment), "pass through, never set empty"


def test_named_volumes_are_declared() -> None:
    declared = set(compose().get("volumes") or {})
    for name, service in services().items():
        for volume in service.get("volumes", []):
            source = volume.partition(":")[0]
            if not source.startswith((".", "/", "~")):
                assert source in declared, f"service {name} uses undeclared volume {source}"


def test_the_default_nats_url_names_the_nats_service() -> None:
    env = " ".join(i.arguments for i in dockerfile_stages()[-1] if i.keyword == "ENV")
    match = re.search(r"FLEETBUS_NATS_URL=nats://([^:\s]+):(\d+)", env)
    assert match, "the image sets FLEETBUS_NATS_URL"
    assert match[1] in services()
    assert match[2] == "4222"


def test_fleetbus_commands_in_compose_are_known() -> None:
    known = known_subcommands()
    commands = [(w, argv) for w, argv in fleetbus_commands() if argv[0] not in PENDING_SUBCOMMANDS]
    assert commands
    for where, argv in commands:
        assert argv[0] in known, f"{where}: fleetbus has no command {argv[0]!r}"
        parse(where, argv)


def test_the_tools_service_serves_a_loadable_toolkit() -> None:
    from fleetbus.tools_workers import load_toolkit

    args = parse("service tools", services()["tools"]["command"])
    assert args.command == "worker"
    assert load_toolkit(args.spec).names


def test_agent_commands_in_compose_are_known() -> None:
    commands = [(w, argv) for w, argv in fleetbus_commands() if argv[0] in PENDING_SUBCOMMANDS]
    assert {argv[0] for _, argv in commands} == PENDING_SUBCOMMANDS
    known = known_subcommands()
    for where, argv in commands:
        assert argv[0] in known, f"{where}: fleetbus has no command {argv[0]!r}"
        parse(where, argv)
    spec = services()["agent"]["command"][1]
    assert importlib.util.find_spec(spec.partition(":")[0]) is not None


# -- Dockerfile and .dockerignore ------------------------------------------------------------


def test_the_image_runs_fleetbus_as_a_non_root_user() -> None:
    stages = dockerfile_stages()
    assert all(stage[0].arguments.split()[0] == "python:3.11-slim" for stage in stages)
    final = stages[-1]
    (entrypoint,) = (i for i in final if i.keyword == "ENTRYPOINT")
    (cmd,) = (i for i in final if i.keyword == "CMD")
    assert exec_form(entrypoint) == ["fleetbus"]
    assert exec_form(cmd) == ["--help"]
    assert "fleetbus" in pyproject()["project"]["scripts"]
    users = [i.arguments for i in final if i.keyword == "USER"]
    assert users, "the image runs as a non-root user"
    assert users[-1].partition(":")[0] not in {"root", "0"}
    env = " ".join(i.arguments for i in final if i.keyword == "ENV")
    assert "PYTHONUNBUFFERED=1" in env
    assert "FLEETBUS_NATS_URL=nats://nats:4222" in env


def test_the_image_installs_the_package_with_uvloop() -> None:
    installs = [
        i.arguments
        for stage in dockerfile_stages()
        for i in stage
        if i.keyword == "RUN" and "pip install" in i.arguments
    ]
    assert installs
    assert all("--no-cache-dir" in run for run in installs)
    assert '".[uvloop]"' in installs[-1] or ".[uvloop]" in installs[-1].split()


def test_the_dockerfile_copies_what_the_build_needs_before_each_install() -> None:
    needed = build_inputs()
    assert {"pyproject.toml", "README.md", "fleetbus"} <= needed
    for stage in dockerfile_stages():
        sources: list[str] = []
        installs = 0
        for instruction in stage:
            if instruction.keyword == "ADD":
                pytest.fail("use COPY, not ADD")
            if instruction.keyword == "COPY":
                new = copy_sources(instruction)
                for source in new:
                    assert covered(source, sorted(needed)), f"copies more than needed: {source}"
                sources += new
            if instruction.keyword == "RUN" and "pip install" in instruction.arguments:
                installs += 1
                missing = {p for p in needed - {"fleetbus"} if not covered(p, sources)}
                assert not missing, f"pip install before copying {sorted(missing)}"
        if installs:
            assert "fleetbus" in sources, "the last install must see the whole package"
            last_copy = max(i for i, ins in enumerate(stage) if ins.keyword == "COPY")
            last_install = max(
                i
                for i, ins in enumerate(stage)
                if ins.keyword == "RUN" and "pip install" in ins.arguments
            )
            assert last_install > last_copy


def test_dockerignore_keeps_the_build_inputs_and_drops_the_rest() -> None:
    inputs = {"pyproject.toml", "README.md"}
    inputs |= {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "fleetbus").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert "fleetbus/__init__.py" in inputs
    assert sorted(p for p in inputs if dockerignore_excludes(p)) == []
    for junk in (".venv/bin/python", ".git/HEAD", "fleetbus/__pycache__/cli.cpython-311.pyc"):
        assert dockerignore_excludes(junk), junk
    for cache_dir in (".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", "tests"):
        assert dockerignore_excludes(f"{cache_dir}/x"), cache_dir
