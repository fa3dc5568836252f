"""Model strings and model settings: one syntax for Python, TOML, the CLI and
the environment.

A model string names a model::

    openai:gpt-4o-mini     an OpenAI-compatible endpoint (OPENAI_BASE_URL, or
                           the base_url setting; else OpenAI with OPENAI_API_KEY)
    bus:NAME               a model worker on the bus (``fleetbus model-worker``)
    offline                the built-in offline model
    package.module:attr    a ChatModel, or a factory of one, in Python
    gpt-4o-mini            a bare name: an OpenAI-compatible model, when
                           OPENAI_BASE_URL or OPENAI_API_KEY is set

``openai:`` and ``bus:`` are reserved prefixes: ``module:attr`` is read only
when both sides are Python dotted names, so ``openai:NAME`` never imports a
module ``openai`` and Ollama's ``llama3.1:8b`` is a bare name. A name such as
``mistral:latest``, which is also valid ``module:attr``, is read as Python;
write ``openai:mistral:latest``.

:class:`ModelSettings` are the settings every model string takes — timeout,
retries, temperature, max tokens, tool mode, fallback, base URL — from the
environment (``FLEETBUS_MODEL_TIMEOUT``…), with values given in code, TOML or
on the command line taking precedence (:func:`load_model_settings`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import re
import sys
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from fleetbus._imports import import_named
from fleetbus.bus import Bus, check_name, discover
from fleetbus.errors import ConfigError
from fleetbus.models.bus_model import BusChatModel
from fleetbus.models.model import ChatModel, ModelConfig, ModelError, ModelRequest, ModelStreamItem
from fleetbus.models.model_worker import MODEL_SERVICE_NAME
from fleetbus.models.offline import OfflineModel
from fleetbus.models.settings import ModelEnvironment, ModelSettings

__all__ = [
    "MODEL_SYNTAX",
    "BusModelRef",
    "ModelSettings",
    "ModelString",
    "check_model",
    "describe_model",
    "load_model_settings",
    "model_config_from_settings",
    "model_from_string",
    "parse_model_string",
    "served_name",
]

MODEL_SYNTAX = "openai:NAME, bus:NAME, offline, or module:attr"
"""The model string syntax, for error messages."""

OFFLINE_DESCRIPTION = (
    "built-in offline model (deterministic, no network; set FLEETBUS_MODEL for a real one: "
    "openai:NAME with OPENAI_BASE_URL or OPENAI_API_KEY, or bus:NAME)"
)

_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_OPENAI_MODULE = "fleetbus.models.openai_model"


def load_model_settings(
    *,
    toml: Mapping[str, Any] | None = None,
    cli: Mapping[str, Any] | None = None,
    where: str = "",
) -> ModelSettings:
    """The settings of a model: command line over TOML over the environment.

    Args:
        toml: the keys of a ``model_settings`` table (field names).
        cli: command-line values by field name; ``None`` values are not given.
        where: names the TOML table in errors, e.g. ``"agents.toml: agent.a.model_settings"``.

    Raises:
        ConfigError: an unknown key or a bad value, named by its TOML key,
            option or environment variable.
    """
    toml = dict(toml or {})
    given = {k: v for k, v in (cli or {}).items() if v is not None}
    fields = ModelSettings.model_fields
    unknown = sorted(set(toml) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where or 'model settings'}: unknown key(s) {', '.join(unknown)}; "
            f"known: {', '.join(fields)}"
        )

    def named(field: str) -> str:
        if field in given:
            return "--model-" + field.replace("_", "-")
        if field in toml:
            return f"{where}.{field}" if where else field
        return "FLEETBUS_MODEL_" + field.upper()

    try:
        return ModelSettings(**{**toml, **given})
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else ""
        raise ConfigError(f"{named(field)}: {error['msg']}") from exc


@dataclasses.dataclass(frozen=True, slots=True)
class ModelString:
    """A parsed model string.

    Attributes:
        kind: ``openai``, ``bus``, ``offline`` or ``python`` (``module:attr``).
        name: the model's name (``openai``, ``bus``) or ``module:attr``.
        explicit: ``openai`` with its prefix (a bare name needs an endpoint).
    """

    kind: Literal["openai", "bus", "offline", "python"]
    name: str
    explicit: bool = True


def parse_model_string(text: str) -> ModelString:
    """Read a model string (see the module docstring).

    Raises:
        ConfigError: an empty string, ``openai:`` or ``bus:`` without a name,
            or a bus name that is empty once made a subject token.
    """
    text = text.strip()
    prefix, colon, rest = text.partition(":")
    if not text:
        raise ConfigError(f"an empty model string; write {MODEL_SYNTAX}")
    if text == "offline":
        return ModelString("offline", "offline")
    if colon and prefix in ("openai", "bus"):
        if not rest:
            raise ConfigError(f"model string {text!r} names no model; write {MODEL_SYNTAX}")
        if prefix == "bus":
            # Found under the name its workers serve it as: bus:gpt-4.1 is gpt-4-1.
            name = served_name(rest)
            check_name(name, what="model name")
            return ModelString("bus", name)
        return ModelString("openai", rest)
    if colon and _DOTTED.fullmatch(prefix) and _DOTTED.fullmatch(rest):
        return ModelString("python", text)
    return ModelString("openai", text, explicit=False)


_NOT_A_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


def served_name(model: str) -> str:
    """The subject token a model is served under: ``gpt-4.1`` -> ``gpt-4-1``.
    ``fleetbus model-worker`` serves a model so by default, and ``bus:NAME``
    looks for it so, whether NAME is written with the dots or without."""
    return _NOT_A_TOKEN.sub("-", model)


def model_from_string(
    text: str, settings: ModelSettings | None = None, *, bus: Bus | None = None
) -> ChatModel:
    """The model a model string names, with ``settings`` applied.

    ``openai:NAME`` gets the temperature, max tokens, tool mode, timeout,
    retries and base URL; ``bus:NAME`` the timeout, temperature and max tokens
    (the tool mode is the model worker's); ``offline`` and ``module:attr``
    models are used as they are. ``fallback`` is not applied here: it belongs
    to :class:`ModelConfig` (:func:`model_config_from_settings`).

    Args:
        text: the model string.
        settings: its settings (default: from the environment).
        bus: the bus a ``bus:NAME`` model uses; without one it is bound later
            (:meth:`BusModelRef.bind`; ``fleetbus agent`` does it).

    Raises:
        ConfigError: not a model string, a bare name with no endpoint
            configured, ``openai:`` with neither ``OPENAI_BASE_URL`` nor
            ``OPENAI_API_KEY``, or a ``module:attr`` that does not load a
            ChatModel.
    """
    spec = parse_model_string(text)
    settings = settings if settings is not None else load_model_settings()
    if spec.kind == "offline":
        return OfflineModel()
    if spec.kind == "bus":
        return BusModelRef(spec.name, settings=settings, bus=bus)
    if spec.kind == "python":
        return _python_model(spec.name)
    env = ModelEnvironment()
    endpoint = settings.base_url or env.openai_base_url
    if not spec.explicit and not (endpoint or env.openai_api_key):
        raise ConfigError(
            f"model {text!r}: a bare name is an OpenAI-compatible model, but neither "
            f"OPENAI_BASE_URL nor OPENAI_API_KEY is set; set one, or write {MODEL_SYNTAX}"
        )
    return _openai_model(spec.name, settings)


def _openai_model(name: str, settings: ModelSettings) -> ChatModel:
    from fleetbus.models.openai_model import OpenAIChatModel, OpenAIConfig

    fields: dict[str, Any] = {
        "temperature": settings.temperature,
        "max_tokens": settings.max_tokens,
        "read_timeout": settings.timeout,
        "max_retries": settings.retries,
        "native_tools": settings.tools,
    }
    try:
        config = OpenAIConfig.model_validate({k: v for k, v in fields.items() if v is not None})
        return OpenAIChatModel(name, base_url=settings.base_url, config=config)
    except (ConfigError, ValidationError) as exc:
        raise ConfigError(f"model 'openai:{name}': {_one_line(exc)}") from exc


def _python_model(spec: str) -> ChatModel:
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = import_named(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"cannot load the model {spec!r}: {exc} (model strings: {MODEL_SYNTAX}; "
            f"a model name with a colon is openai:{spec})"
        ) from exc
    if isinstance(target, type) or (callable(target) and not isinstance(target, ChatModel)):
        target = target()
    if not isinstance(target, ChatModel):
        raise ConfigError(f"the model {spec!r} is not a ChatModel or a factory of one")
    return target


def _one_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        error = exc.errors()[0]
        return f"{'.'.join(map(str, error['loc']))}: {error['msg']}"
    return str(exc).splitlines()[0]


def model_config_from_settings(
    settings: ModelSettings, *, base: ModelConfig | None = None, bus: Bus | None = None
) -> ModelConfig:
    """``base`` (default ``ModelConfig()``) with the timeout, retries and
    fallback of ``settings`` (those that are set).

    Args:
        settings: the settings; the fallback model gets the same ones.
        base: the configuration to update.
        bus: for a ``bus:NAME`` fallback (see :func:`model_from_string`).

    Raises:
        ConfigError: the fallback is not a usable model string.
    """
    update: dict[str, Any] = {}
    if settings.timeout is not None:
        update["timeout"] = settings.timeout
    if settings.retries is not None:
        update["max_retries"] = settings.retries
    if settings.fallback is not None:
        own = settings.model_copy(update={"fallback": None})
        try:
            update["fallback"] = model_from_string(settings.fallback, own, bus=bus)
        except ConfigError as exc:
            raise ConfigError(f"the fallback model: {exc}") from exc
    base = base or ModelConfig()
    return base.model_copy(update=update) if update else base


class BusModelRef:
    """The model of a ``bus:NAME`` string: a :class:`BusChatModel` on a bus
    given now or bound later, with the settings' temperature and max tokens
    added to each request's options (the model worker passes them on).

    Args:
        name: the name the model is served as.
        settings: its timeout, temperature and max tokens.
        bus: the bus; without one, :meth:`bind` it before the first call.

    Raises:
        ConfigError: the name is not a subject token.
    """

    def __init__(
        self, name: str, *, settings: ModelSettings | None = None, bus: Bus | None = None
    ) -> None:
        self._name = check_name(name, what="model name")
        settings = settings or ModelSettings()
        self.timeout = settings.timeout or 120.0
        self.options: dict[str, Any] = {
            k: v
            for k, v in (("temperature", settings.temperature), ("max_tokens", settings.max_tokens))
            if v is not None
        }
        self._model: BusChatModel | None = None
        if bus is not None:
            self.bind(bus)

    @property
    def name(self) -> str:
        """The name the model is served as."""
        return self._name

    @property
    def bus(self) -> Bus | None:
        """The bus it is bound to."""
        return None if self._model is None else self._model.bus

    def bind(self, bus: Bus) -> None:
        """Call the model over ``bus`` from now on."""
        self._model = BusChatModel(bus, self._name, timeout=self.timeout)

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        """Run the call on a model worker (see :meth:`BusChatModel.stream`).

        Raises:
            ModelError: not bound to a bus, or the call failed.
        """
        if self._model is None:
            raise ModelError(
                f"bus:{self._name} is not bound to a bus: pass bus= to model_from_string "
                "or call bind(bus)",
                retryable=False,
            )
        if self.options:
            request = dataclasses.replace(request, options={**self.options, **request.options})
        async with contextlib.aclosing(self._model.stream(request)) as items:
            async for item in items:
                yield item

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until a model worker serves the model on the bound bus.

        Raises:
            ConfigError: not bound, or no worker serves it within ``timeout`` seconds.
            BusError: the discovery request could not be sent.
        """
        bus = self.bus
        if bus is None:
            raise ConfigError(f"bus:{self._name} is not bound to a bus")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            services = await discover(bus, MODEL_SERVICE_NAME, timeout=min(0.5, timeout))
            if any(
                endpoint.name == self._name
                for service in services
                if service.metadata.get("fleetbus_prefix") == bus.prefix
                for endpoint in service.endpoints
            ):
                return
            if loop.time() >= deadline:
                raise ConfigError(
                    f"model bus:{self._name}: no model worker serves it on prefix "
                    f"{bus.prefix!r} (waited {timeout:g} s); start one with "
                    f"`fleetbus model-worker --model MODEL --serve-as {self._name}`"
                )
            await asyncio.sleep(0.2)


async def check_model(model: ChatModel, *, timeout: float = 10.0) -> None:
    """Fail fast when a configured model cannot be reached: a ``bus:NAME``
    model with no model worker serving it within ``timeout`` seconds, or an
    OpenAI-compatible endpoint that takes no connection (a TCP connection to
    its host and port; a wrong model name or a refused key is reported on the
    first call). Other models pass.

    Raises:
        ConfigError: the model cannot be reached, named with its setting.
        BusError: the discovery request could not be sent.
    """
    if isinstance(model, BusModelRef):
        await model.wait_ready(timeout)
        return
    openai_model = sys.modules.get(_OPENAI_MODULE)
    if openai_model is None or not isinstance(model, openai_model.OpenAIChatModel):
        return
    base_url: str = model.base_url
    url = urllib.parse.urlsplit(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(url.hostname, port), min(timeout, 5.0)
        )
    except OSError as exc:  # TimeoutError included
        env = (ModelEnvironment().openai_base_url or "").rstrip("/")
        where = " (OPENAI_BASE_URL)" if env == base_url else ""
        reason = exc.strerror or str(exc) or "no connection within the time allowed"
        raise ConfigError(
            f"model openai:{model.name}: cannot reach {base_url}{where}: {reason}"
            + _loopback_in_container_hint(url.hostname)
        ) from exc
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


_CONTAINER_MARKERS = (Path("/.dockerenv"), Path("/run/.containerenv"))
"""Files Docker and Podman put in every container they run."""


def _loopback_in_container_hint(host: str | None) -> str:
    """What to say when a process in a container is pointed at a loopback
    address: there it is the container itself, not the machine it runs on."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        loopback = False
    if not loopback or not any(marker.exists() for marker in _CONTAINER_MARKERS):
        return ""
    return (
        f" ({host} in this container is the container itself: a server on the Docker"
        " host is http://host.docker.internal:PORT/v1, a name docker-compose.yml maps"
        " for the model worker (docker run: --add-host=host.docker.internal:host-gateway),"
        " and it must listen on more than 127.0.0.1)"
    )


def describe_model(model: ChatModel) -> str:
    """One line for people: which model this is, as a model string."""
    if isinstance(model, OfflineModel):
        return OFFLINE_DESCRIPTION
    if isinstance(model, BusModelRef | BusChatModel):
        return f"bus:{model.name} (model workers on the bus)"
    openai_model = sys.modules.get(_OPENAI_MODULE)
    if openai_model is not None and isinstance(model, openai_model.OpenAIChatModel):
        return f"openai:{model.name} at {model.base_url}"
    return f"{model.name} ({type(model).__name__})"
