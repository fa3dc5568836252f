"""The Kubernetes set-up of ``deploy/k8s``, checked offline (no cluster, no Helm).

Every manifest is valid against the Kubernetes JSON Schemas bundled by
kubernetes-validate (strict: a misspelt field is an error), for the oldest
and the newest Kubernetes release checked. The manifests describe the fleet
we mean: every container runs the fleetbus image with a command the CLI
parses, as a non-root user with resources and probes; workers drain within
their grace period under their pod's name; Services and budgets select the
pods they are for; no Secret value is committed. The values of the NATS Helm
chart ask for a 3-server JetStream cluster on a supported nats-server, with
``sync_interval: always``, under the names the fleet's URL lists.
"""

from __future__ import annotations

import copy
import inspect
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from fleetbus import __version__
from fleetbus.agents.serving.host import AgentHost
from fleetbus.bus import MIN_SERVER_VERSION
from fleetbus.bus._server_version import server_release
from fleetbus.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATION = K8S / "kustomization.yaml"
NATS_VALUES = K8S / "nats-values.yaml"
SECRET_EXAMPLE = K8S / "secret.example.yaml"
DOCS = ROOT / "docs" / "kubernetes.md"
DOCKERFILE = ROOT / "Dockerfile"

NOT_RESOURCES = {KUSTOMIZATION.name, NATS_VALUES.name, SECRET_EXAMPLE.name}
"""The files of deploy/k8s that ``kubectl apply -k`` does not apply."""

KUBERNETES_VERSIONS = ("1.29.0", "latest")
"""The releases checked: the oldest still in common use, and the newest the
package knows."""

IMAGE = "fleetbus"
PLACEHOLDER = "REPLACE-WITH"
GRACE_MARGIN = 15
"""Most seconds a pod's grace period may exceed its drain timeout."""

VALIDATOR_MISSING = (
    "kubernetes-validate is not installed (the dev extra): the Kubernetes JSON "
    "Schemas are not checked"
)


# -- loading ---------------------------------------------------------------------------------


def load_all(path: Path) -> list[dict[str, Any]]:
    documents = YAML(typ="safe", pure=True).load_all(path.read_text(encoding="utf-8"))
    loaded = [document for document in documents if document is not None]
    assert all(isinstance(document, dict) for document in loaded), path
    return loaded


@cache
def kustomization() -> dict[str, Any]:
    (document,) = load_all(KUSTOMIZATION)
    return document


def resource_files() -> list[Path]:
    return [K8S / name for name in kustomization()["resources"]]


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) of every resource ``kubectl apply -k`` applies."""
    return [(path.name, document) for path in resource_files() for document in load_all(path)]


def of_kind(kind: str) -> dict[str, dict[str, Any]]:
    """The resources of ``kind``, by name."""
    return {d["metadata"]["name"]: d for _, d in manifests() if d["kind"] == kind}


def deployments() -> dict[str, dict[str, Any]]:
    found = of_kind("Deployment")
    assert found
    return found


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    pod = deployment["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def main_container(name: str) -> dict[str, Any]:
    (container,) = deployments()[name]["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = container
    return found


def option(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container.get("env", [])}


@cache
def nats_values() -> dict[str, Any]:
    (document,) = load_all(NATS_VALUES)
    return document


# -- schemas ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def validator() -> Any:
    return pytest.importorskip("kubernetes_validate", reason=VALIDATOR_MISSING)


def schema_errors(validator: Any, document: dict[str, Any], version: str) -> list[str]:
    """What the Kubernetes schema of ``document``'s kind finds wrong with it
    (strict); a kind without a schema is an error too."""
    if version == "latest":
        version = validator.latest_version()
    where = f"{document.get('kind')}/{document.get('metadata', {}).get('name')}"
    try:
        validator.validate(document, version, strict=True)
    except validator.ValidationError as exc:
        path = "/".join(map(str, exc.path)) or "<root>"
        return [f"{where}: {path}: {exc.message}"]
    except validator.SchemaNotFoundError as exc:
        return [f"{where}: {exc.message}"]
    return []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_follows_the_kubernetes_schemas(validator: Any, version: str) -> None:
    documents = [*manifests(), *((SECRET_EXAMPLE.name, d) for d in load_all(SECRET_EXAMPLE))]
    kinds = {d["kind"] for _, d in documents}
    assert {"Deployment", "Service", "ConfigMap", "Secret"} <= kinds
    errors = [f"{name}: {e}" for name, d in documents for e in schema_errors(validator, d, version)]
    assert errors == []


def test_the_schema_check_catches_mistakes(validator: Any) -> None:
    tools = deployments()["fleetbus-tools"]
    misspelt = copy.deepcopy(tools)
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    assert schema_errors(validator, misspelt, "latest")
    wrong_type = copy.deepcopy(tools)
    wrong_type["spec"]["replicas"] = "two"
    assert schema_errors(validator, wrong_type, "latest")
    unknown_kind = {"apiVersion": "v1", "kind": "Deploymnet", "metadata": {"name": "x"}}
    assert schema_errors(validator, unknown_kind, "latest")


def test_the_rendered_kustomization_follows_the_schemas(validator: Any) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize deploy/k8s` is not rendered")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    documents = [d for d in YAML(typ="safe", pure=True).load_all(rendered) if d is not None]
    assert len(documents) == len(manifests())
    errors = [e for d in documents for e in schema_errors(validator, d, "latest")]
    assert errors == []
    images = {
        container["image"]
        for d in documents
        if d["kind"] == "Deployment"
        for container in containers(d)
    }
    (entry,) = kustomization()["images"]
    assert images == {f"{entry['newName']}:{entry['newTag']}"}
    assert all(
        d["metadata"].get("namespace") == "fleetbus" for d in documents if d["kind"] != "Namespace"
    )


# -- what the manifests describe -------------------------------------------------------------


def test_the_kustomization_applies_every_manifest_and_no_secret() -> None:
    listed = [path.name for path in resource_files()]
    on_disk = sorted(p.name for p in K8S.glob("*.yaml") if p.name not in NOT_RESOURCES)
    assert sorted(listed) == on_disk
    assert len(set(listed)) == len(listed)
    assert kustomization()["namespace"] == "fleetbus"
    assert set(of_kind("Namespace")) == {"fleetbus"}


def test_the_fleet_is_there() -> None:
    assert set(deployments()) == {
        "fleetbus-tools",
        "fleetbus-agent",
        "fleetbus-model-worker",
        "fleetbus-dashboard",
        "fleetbus-gateway",
    }
    assert set(of_kind("Service")) == {"fleetbus-dashboard", "fleetbus-gateway"}
    commands = {name: main_container(name)["args"][0] for name in deployments()}
    assert commands == {
        "fleetbus-tools": "worker",
        "fleetbus-agent": "agent",
        "fleetbus-model-worker": "model-worker",
        "fleetbus-dashboard": "dashboard",
        "fleetbus-gateway": "gateway",
    }
    assert deployments()["fleetbus-agent"]["spec"]["replicas"] == 2
    agent = main_container("fleetbus-agent")
    assert "--replicas" not in agent["args"], "one replica per pod; the Deployment has two"
    assert deployments()["fleetbus-dashboard"]["spec"]["replicas"] == 1, "one page token"


def test_every_container_runs_the_fleetbus_image() -> None:
    for name, deployment in deployments().items():
        for container in containers(deployment):
            assert container["image"] == IMAGE, f"{name}: {container['image']}"
    (entry,) = kustomization()["images"]
    assert entry["name"] == IMAGE
    assert entry["newTag"] == __version__, "the manifests deploy the release they ship with"


EXTRAS = {"dashboard": "dashboard", "gateway": "gateway"}
"""The extra of the package each command needs, beyond its dependencies."""


def image_extras() -> set[str]:
    """The extras the Dockerfile's last ``pip install ".[…]"`` installs."""
    installs = re.findall(r'pip install [^\n]*"\.\[([^\]]*)\]"', DOCKERFILE.read_text("utf-8"))
    assert installs, "the Dockerfile installs the package with its extras"
    return {extra.strip() for extra in installs[-1].split(",")}


def test_the_image_has_what_each_command_needs() -> None:
    commands = {main_container(name)["args"][0] for name in deployments()}
    needed = {EXTRAS[command] for command in commands if command in EXTRAS}
    assert needed == {"dashboard", "gateway"}
    assert needed <= image_extras()


def substituted(words: list[str]) -> list[str]:
    """``words`` with Kubernetes' ``$(VAR)`` references replaced by a sample value."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", "fleetbus-x-1", word) for word in words]


def parse(where: str, argv: list[str]) -> Any:
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: 'fleetbus {shlex.join(argv)}' does not parse (exit {exc.code})")


def probe_commands(container: dict[str, Any]) -> list[list[str]]:
    """The fleetbus command lines of the container's exec probes (of ``sh -c``
    scripts, each stage of the pipeline that runs fleetbus)."""
    found: list[list[str]] = []
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        command = container.get(kind, {}).get("exec", {}).get("command")
        if command is None:
            continue
        if command[:2] == ["sh", "-c"]:
            stages = [shlex.split(stage) for stage in command[2].split("|")]
            found += [stage for stage in stages if stage and stage[0] == IMAGE]
        elif command[0] == IMAGE:
            found.append(command)
    return found


def test_fleetbus_commands_parse() -> None:
    for name in deployments():
        container = main_container(name)
        assert "command" not in container, f"{name}: keep the image's entrypoint (fleetbus)"
        parse(name, substituted(container["args"]))
        for argv in probe_commands(container):
            parse(f"{name} probe", argv[1:])


def test_every_deployment_has_probes_that_reach_it() -> None:
    for name, deployment in deployments().items():
        for container in containers(deployment):
            ports = {p["name"] for p in container.get("ports", [])}
            for kind in ("readinessProbe", "livenessProbe"):
                probe = container.get(kind)
                assert probe, f"{name}: no {kind}"
                assert {"exec", "httpGet", "tcpSocket", "grpc"} & set(probe), f"{name}: {kind}"
                if "httpGet" in probe:
                    assert probe["httpGet"]["port"] in ports, f"{name}: {kind} port"
                if "exec" in probe and probe["exec"]["command"][0] != "python":
                    assert probe_commands(container), f"{name}: {kind} runs no fleetbus command"


def test_agents_and_model_workers_are_ready_once_their_own_process_serves() -> None:
    for name, kind in (("fleetbus-agent", "agents"), ("fleetbus-model-worker", "models")):
        probe = main_container(name)["readinessProbe"]["exec"]["command"]
        assert probe == ["python", "/opt/fleetbus/healthcheck.py", kind], name


def test_the_gateway_readiness_probe_asks_its_own_port() -> None:
    container = main_container("fleetbus-gateway")
    port = option(container["args"], "--port")
    script = container["readinessProbe"]["exec"]["command"][2]
    compile(script, "readinessProbe", "exec")
    assert f"http://127.0.0.1:{port}/healthz" in script
    assert container["ports"][0]["containerPort"] == int(port)
    dashboard = main_container("fleetbus-dashboard")
    assert dashboard["ports"][0]["containerPort"] == int(option(dashboard["args"], "--port"))


def test_workers_are_named_after_their_pods() -> None:
    for name in ("fleetbus-tools", "fleetbus-model-worker"):
        container = main_container(name)
        assert option(container["args"], "--worker-id") == "$(POD_NAME)"
        env = env_of(container)
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    tools = main_container("fleetbus-tools")
    for kind in ("readinessProbe", "livenessProbe"):
        script = tools[kind]["exec"]["command"][2]
        assert 'grep -qF "\\"$POD_NAME\\""' in script, "ready when its own worker id is listed"
        assert "--json" in script


def test_workers_drain_within_their_grace_period() -> None:
    for name in ("fleetbus-tools", "fleetbus-model-worker"):
        drain = float(option(main_container(name)["args"], "--drain-timeout"))
        grace = deployments()[name]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert drain <= grace <= drain + GRACE_MARGIN, f"{name}: grace {grace}, drain {drain}"
    drain = inspect.signature(AgentHost).parameters["drain_timeout"].default
    grace = deployments()["fleetbus-agent"]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    assert drain <= grace <= drain + GRACE_MARGIN


def image_user() -> int:
    users = re.findall(r"^USER\s+(\d+)(?::\d+)?\s*$", DOCKERFILE.read_text(encoding="utf-8"), re.M)
    assert users, "the Dockerfile names its user by uid"
    return int(users[-1])


def test_pods_run_as_the_image_user_with_resources() -> None:
    uid = image_user()
    assert uid != 0
    for name, deployment in deployments().items():
        pod = deployment["spec"]["template"]["spec"]
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["runAsUser"] == uid, name
        assert pod["automountServiceAccountToken"] is False, name
        for container in containers(deployment):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), name
            assert "memory" in resources["limits"], name
            if security.get("readOnlyRootFilesystem"):
                mounted = {m["mountPath"] for m in container.get("volumeMounts", [])}
                assert "/tmp" in mounted, f"{name}: a read-only root needs a writable /tmp"
    workspace = env_of(main_container("fleetbus-tools"))["FLEETBUS_FILES_ROOT"]["value"]
    mounts = {m["mountPath"] for m in main_container("fleetbus-tools")["volumeMounts"]}
    assert workspace in mounts, "the file tools' root is a writable volume"


def test_services_and_budgets_select_the_pods_they_are_for() -> None:
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deployments().items()}

    def selected(selector: dict[str, str]) -> list[str]:
        return [n for n, pod in labels.items() if selector.items() <= pod.items()]

    for name, deployment in deployments().items():
        assert selected(deployment["spec"]["selector"]["matchLabels"]) == [name]
    for name, service in of_kind("Service").items():
        (target,) = selected(service["spec"]["selector"])
        assert target == name
        ports = {p["name"] for p in main_container(target).get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"service {name}: {port}"
    budgets = of_kind("PodDisruptionBudget")
    assert {"fleetbus-agent", "fleetbus-gateway", "fleetbus-tools"} <= set(budgets)
    for name, budget in budgets.items():
        assert selected(budget["spec"]["selector"]["matchLabels"]) == [name]
    for name, policy in of_kind("NetworkPolicy").items():
        assert selected(policy["spec"]["podSelector"]["matchLabels"]) == [name]
    assert of_kind("NetworkPolicy")["fleetbus-dashboard"]["spec"]["ingress"] == []


def test_every_pod_reads_the_fleet_settings() -> None:
    (config,) = of_kind("ConfigMap").values()
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "fleetbus").rglob("*.py"))
    for key in config["data"]:
        assert re.search(rf"\b{key}\b", sources), f"fleetbus reads no variable {key}"
    for name in deployments():
        refs = [r["configMapRef"]["name"] for r in main_container(name).get("envFrom", [])]
        assert refs == [config["metadata"]["name"]], name


# -- secrets ---------------------------------------------------------------------------------


SECRET_NAMES = re.compile(r"KEY|TOKEN|PASSWORD|SECRET|CREDS|NKEY", re.I)


def test_no_secret_value_is_committed() -> None:
    for path in K8S.glob("*.yaml"):
        if path in (SECRET_EXAMPLE, NATS_VALUES, KUSTOMIZATION):
            continue
        kinds = {d["kind"] for d in load_all(path)}
        assert "Secret" not in kinds, f"{path.name} holds a Secret: keep only secret.example.yaml"
    assert SECRET_EXAMPLE.name not in kustomization()["resources"]
    examples = load_all(SECRET_EXAMPLE)
    assert {d["kind"] for d in examples} == {"Secret"}
    for secret in examples:
        assert "data" not in secret, "placeholders only, in stringData"
        for key, value in secret["stringData"].items():
            assert PLACEHOLDER in value, f"{secret['metadata']['name']}/{key} is not a placeholder"
    (config,) = of_kind("ConfigMap").values()
    assert not [k for k in config["data"] if SECRET_NAMES.search(k)], "a secret in the ConfigMap"
    for name, deployment in deployments().items():
        for container in containers(deployment):
            for variable, item in env_of(container).items():
                if SECRET_NAMES.search(variable):
                    assert "value" not in item, f"{name}: {variable} is set in the manifest"
                    assert "secretKeyRef" in item["valueFrom"], f"{name}: {variable}"


def secret_references(deployment: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(variable, Secret, key) of every variable a Deployment reads from a Secret."""
    found: set[tuple[str, str, str]] = set()
    for container in containers(deployment):
        for variable, item in env_of(container).items():
            ref = item.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                found.add((variable, ref["name"], ref["key"]))
        assert not [r for r in container.get("envFrom", []) if "secretRef" in r]
    return found


def test_the_api_key_reaches_the_model_worker_only() -> None:
    references = {name: secret_references(d) for name, d in deployments().items()}
    assert references == {
        "fleetbus-tools": set(),
        "fleetbus-agent": set(),
        "fleetbus-model-worker": {("OPENAI_API_KEY", "fleetbus-model-api", "OPENAI_API_KEY")},
        "fleetbus-dashboard": set(),
        "fleetbus-gateway": {("FLEETBUS_GATEWAY_TOKENS", "fleetbus-gateway", "tokens.json")},
    }
    from fleetbus.gateway.auth import TOKENS_VARIABLE

    assert TOKENS_VARIABLE == "FLEETBUS_GATEWAY_TOKENS"
    examples = {
        (d["metadata"]["name"], key) for d in load_all(SECRET_EXAMPLE) for key in d["stringData"]
    }
    wanted = {(secret, key) for refs in references.values() for _, secret, key in refs}
    assert examples == wanted, "secret.example.yaml shows every Secret the fleet reads"
    agent = env_of(main_container("fleetbus-agent"))
    assert agent["FLEETBUS_MODEL"]["value"] == "bus:" + option(
        main_container("fleetbus-model-worker")["args"], "--serve-as"
    ), "the agents call the model the model worker serves"


# -- the NATS chart --------------------------------------------------------------------------


def chart_release(tag: str) -> tuple[int, int, int]:
    match = re.fullmatch(r"(\d+\.\d+\.\d+)(?:-alpine)?", tag)
    assert match is not None, f"pin a full nats-server release, not {tag!r}"
    release = server_release(match[1])
    assert release is not None
    return release


def test_nats_runs_a_three_server_jetstream_cluster_that_fsyncs() -> None:
    config = nats_values()["config"]
    assert config["cluster"]["enabled"] is True
    assert config["cluster"]["replicas"] == 3
    jetstream = config["jetstream"]
    assert jetstream["enabled"] is True
    file_store = jetstream["fileStore"]
    assert file_store["enabled"] is True
    assert file_store["pvc"]["enabled"] is True
    assert re.fullmatch(r"\d+[GT]i", file_store["pvc"]["size"])
    assert jetstream["merge"] == {"sync_interval": "always"}
    assert config["monitor"]["enabled"] is True, "the chart's probes read /healthz"


def test_nats_is_a_release_fleetbus_supports() -> None:
    image = nats_values()["container"]["image"]
    assert image["repository"] == "nats"
    minimum = server_release(MIN_SERVER_VERSION)
    assert minimum is not None
    assert chart_release(image["tag"]) >= minimum


def test_the_fleet_url_lists_every_server_of_the_chart() -> None:
    (config,) = of_kind("ConfigMap").values()
    urls = config["data"]["FLEETBUS_NATS_URL"].split(",")
    release = "nats"
    replicas = nats_values()["config"]["cluster"]["replicas"]
    assert urls == [f"nats://{release}-{i}.{release}-headless:4222" for i in range(replicas)]
    text = DOCS.read_text(encoding="utf-8")
    installs = re.findall(r"helm (?:install|upgrade --install) (\S+) nats/nats\b[^\n]*", text)
    assert installs
    assert set(installs) == {release}, "the docs install the release the URL names"
    values_header = NATS_VALUES.read_text(encoding="utf-8")
    assert f"helm install {release} nats/nats" in values_header


def test_the_docs_install_the_chart_of_the_pinned_server() -> None:
    tag = chart_release(nats_values()["container"]["image"]["tag"])
    wanted = ".".join(map(str, tag))
    for text in (DOCS.read_text(encoding="utf-8"), NATS_VALUES.read_text(encoding="utf-8")):
        versions = set(re.findall(r"nats/nats\b[^\n]*--version (\S+)", text))
        assert versions == {wanted}, f"chart {versions}, server {wanted}"
