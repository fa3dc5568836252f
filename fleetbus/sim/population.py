"""Populations: many agents from one template and per-agent parameters.

A :class:`Population` is N agents described by one :class:`AgentTemplate`
(the system prompt with ``{placeholders}``, the model, or a model per group,
the tools) and a row of parameters per agent (a background, a persona, a
group…), given as a table (CSV or JSON Lines) or by a generator function::

    template = AgentTemplate(
        system_prompt="You are {background}. You think {k} steps ahead.",
        models={"small": "offline", "large": "openai:gpt-4o-mini"},  # by params["group"]
        tools=["calculator"],
    )
    people = Population.from_table("people.csv", template=template)
    many = Population.generate(10_000, lambda i: {"k": i % 4, "background": "…"},
                               template=template)

It is the :class:`~fleetbus.agents.serving.host.AgentSource` an
:class:`~fleetbus.agents.serving.host.AgentHost` serves: ``name in
population`` is a dictionary lookup (a table) or a parse of the name (a
generator), and ``population.agent(name)`` builds that agent's definition on
demand. Nothing is built up front: a generated population holds no memory per
agent, a table one row of values (a tuple) per agent.
"""

from __future__ import annotations

import asyncio
import csv
import re
import string
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from fleetbus.agents.agent import Agent
from fleetbus.agents.settings import AgentSettings
from fleetbus.bus import Bus, ToolClient, check_name
from fleetbus.errors import ConfigError, InvalidSubjectError
from fleetbus.models import (
    BusModelRef,
    ChatModel,
    ModelConfig,
    default_model,
    default_model_config,
    model_from_string,
)
from fleetbus.models.strings import check_model
from fleetbus.tools_workers import RemoteToolProxy, Toolkit

__all__ = ["AgentTemplate", "Params", "Population"]

Params = Mapping[str, Any]
"""One agent's parameters: column name to value."""

TOOL_WAIT = 30.0
_TUNING = frozenset(AgentSettings.model_fields)
"""The options of a template that tune the loop (the rest are Agent's keywords)."""
"""Seconds :meth:`Population.bind` waits for the tool workers by default."""


@dataclass(frozen=True, kw_only=True)
class AgentTemplate:
    """What every agent of a population shares.

    Attributes:
        system_prompt: the system prompt, a ``str.format`` template filled
            with the agent's parameters and ``{name}`` / ``{index}``; each
            placeholder must be a column of the population.
        model: the model of every agent: a model string (``offline``,
            ``openai:NAME``, ``bus:NAME``, ``module:attr``) or a
            :class:`~fleetbus.models.ChatModel`; ``None`` is the fleet's
            default (``FLEETBUS_MODEL``, else the offline model).
        models: a model per group: the agents whose ``group_by`` parameter
            is a key of this mapping get its model. An agent's own ``model``
            parameter (a model string) wins over both.
        group_by: the parameter that names an agent's group.
        tools: the names of the tools (served on the bus) the agents get;
            ``None``: every tool of the simulation.
        max_iters: reasoning steps per reply.
        model_config: retries, timeout and fallback of model calls;
            ``None``: from ``FLEETBUS_MODEL_*``.
        options: more of the agents' tuning (fields of
            :class:`~fleetbus.agents.AgentSettings`: ``tool_timeout``,
            ``parallel_tool_calls``…) and keyword arguments of
            :class:`~fleetbus.agents.Agent` (``capabilities``…).
    """

    system_prompt: str = ""
    model: str | ChatModel | None = None
    models: Mapping[str, str | ChatModel] = field(default_factory=dict)
    group_by: str = "group"
    tools: Sequence[str] | None = None
    max_iters: int = 3
    model_config: ModelConfig | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def placeholders(self) -> list[str]:
        """The parameters the system prompt names (without ``name`` and ``index``).

        Raises:
            ConfigError: the system prompt is not a valid format string.
        """
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(self.system_prompt) if f]
        except ValueError as exc:
            raise ConfigError(f"the system prompt template is not valid: {exc}") from exc
        out: list[str] = []
        for f in fields:
            key = f.split(".", 1)[0].split("[", 1)[0]
            if key and key not in ("name", "index") and key not in out:
                out.append(key)
        return out


class _Rows:
    """A table: names, their index, and one tuple of values per row."""

    __slots__ = ("columns", "index", "names", "rows", "source")

    def __init__(
        self, source: str, columns: list[str], names: list[str], rows: list[tuple[Any, ...]]
    ) -> None:
        self.source = source
        self.columns = columns
        self.names = names
        self.rows = rows
        self.index = {name: i for i, name in enumerate(names)}


class _Generated:
    """``count`` agents named ``<prefix><i>``, their parameters from ``fn(i)``."""

    __slots__ = ("count", "fn", "prefix")

    def __init__(self, count: int, fn: Callable[[int], Params] | None, prefix: str) -> None:
        self.count = count
        self.fn = fn
        self.prefix = prefix

    def index(self, name: object) -> int | None:
        if not isinstance(name, str) or not name.startswith(self.prefix):
            return None
        digits = name[len(self.prefix) :]
        if not (digits.isascii() and digits.isdigit()) or (len(digits) > 1 and digits[0] == "0"):
            return None
        i = int(digits)
        return i if i < self.count else None


class Population:
    """N agents from a template and per-agent parameters, built on demand.

    Make one with :meth:`generate`, :meth:`from_table` or :meth:`from_rows`.
    Iterating gives the agents' names in order; ``len()`` their number.
    """

    def __init__(self, template: AgentTemplate, backing: _Rows | _Generated) -> None:
        self.template = template
        self._backing = backing
        self._override: str | None = None
        self._models: dict[str, ChatModel] = {}
        self._default: ChatModel | None = None
        self._model_config: ModelConfig | None = template.model_config
        self._settings: AgentSettings | None = None
        """Every agent's settings: one (frozen) object for the population."""
        self._toolkit: Toolkit | None = None
        self._bus: Bus | None = None

    # -- making one ----------------------------------------------------------------

    @classmethod
    def generate(
        cls,
        count: int,
        params: Callable[[int], Params] | None = None,
        *,
        template: AgentTemplate,
        name_prefix: str = "agent-",
    ) -> Population:
        """``count`` agents named ``<name_prefix>0`` … ``<name_prefix><count-1>``.

        Args:
            count: how many.
            params: the parameters of agent ``i`` (called on demand, maybe
                often: make it cheap and deterministic, e.g. a
                ``random.Random(seed + i)``); no parameters when ``None``.
            template: what the agents share.
            name_prefix: the start of every name (letters, digits, ``_``, ``-``).

        Raises:
            ConfigError: a negative count, a prefix that cannot start a
                subject token, or parameters that lack a placeholder of the
                system prompt.
        """
        if count < 0:
            raise ConfigError(f"a population has 0 or more agents, not {count}")
        try:
            check_name(f"{name_prefix}0", what="agent name prefix")
        except InvalidSubjectError as exc:
            raise ConfigError(str(exc)) from exc
        population = cls(template, _Generated(count, params, name_prefix))
        if count:
            population._check_params(population.params_at(0), f"the parameters of {name_prefix}0")
        return population

    @classmethod
    def from_rows(
        cls,
        rows: Iterable[Params],
        *,
        template: AgentTemplate,
        name_column: str | None = "name",
        source: str = "rows",
    ) -> Population:
        """One agent per row of parameters.

        Args:
            rows: the rows.
            template: what the agents share.
            name_column: the column holding each agent's name; ``None``:
                name them ``agent-0``, ``agent-1``… in order.
            source: what to call the rows in errors (a file name).

        Raises:
            ConfigError: a row without the name column or a placeholder of
                the system prompt, a name that cannot be a subject token, or
                two rows with one name.
        """
        columns: list[str] = []
        seen: set[str] = set()
        dicts: list[Params] = []
        for row in rows:
            dicts.append(row)
            for key in row:
                if key not in seen:
                    seen.add(key)
                    columns.append(key)
        required = template.placeholders()
        if name_column is not None:
            required = [name_column, *required]
        missing = [c for c in required if c not in seen]
        if dicts and missing:
            what = "column" if len(missing) == 1 else "columns"
            raise ConfigError(
                f"{source}: no {what} {', '.join(map(repr, missing))} "
                f"(columns: {', '.join(columns) or 'none'})"
            )
        value_columns = [c for c in columns if c != name_column]
        names: list[str] = []
        values: list[tuple[Any, ...]] = []
        for number, row in enumerate(dicts, start=1):
            absent = [c for c in required if row.get(c) is None]
            if absent:
                raise ConfigError(f"{source}: row {number} has no {', '.join(map(repr, absent))}")
            name = (
                str(row[name_column]).strip() if name_column is not None else f"agent-{number - 1}"
            )
            try:
                check_name(name, what="agent name")
            except InvalidSubjectError as exc:
                raise ConfigError(f"{source}: row {number}: {exc}") from exc
            names.append(name)
            values.append(tuple(row.get(c) for c in value_columns))
        backing = _Rows(source, value_columns, names, values)
        if len(backing.index) != len(names):
            duplicate = next(n for i, n in enumerate(names) if backing.index[n] != i)
            raise ConfigError(f"{source}: two rows name the agent {duplicate!r}")
        return cls(template, backing)

    @classmethod
    def from_table(
        cls,
        path: str | Path,
        *,
        template: AgentTemplate,
        name_column: str | None = "name",
    ) -> Population:
        """One agent per row of a CSV file (``.csv``, a header line first) or a
        JSON Lines file (``.jsonl``/``.ndjson``, one object a line).

        CSV values that read as integers or decimals become numbers.

        Raises:
            ConfigError: the file cannot be read or parsed, or its rows do
                not fit (see :meth:`from_rows`).
        """
        path = Path(path)
        suffix = path.suffix.lower()
        try:
            if suffix == ".csv":
                with path.open(newline="", encoding="utf-8") as f:
                    rows: list[Params] = [
                        {k: _number(v) for k, v in row.items() if k is not None}
                        for row in csv.DictReader(f)
                    ]
            elif suffix in (".jsonl", ".ndjson"):
                rows = _json_lines(path)
            else:
                raise ConfigError(f"{path}: a population table is .csv, .jsonl or .ndjson")
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
        except (csv.Error, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        return cls.from_rows(rows, template=template, name_column=name_column, source=str(path))

    def with_size(self, count: int) -> Population:
        """The same population with ``count`` agents: a generated one grows or
        shrinks; a table keeps its first ``count`` rows.

        Raises:
            ConfigError: ``count`` is negative, or more rows than the table has.
        """
        backing = self._backing
        if count < 0:
            raise ConfigError(f"a population has 0 or more agents, not {count}")
        if isinstance(backing, _Generated):
            return Population.generate(
                count, backing.fn, template=self.template, name_prefix=backing.prefix
            )
        if count > len(backing.names):
            raise ConfigError(
                f"{backing.source} has {len(backing.names)} agents; it cannot make {count}"
            )
        rows = _Rows(backing.source, backing.columns, backing.names[:count], backing.rows[:count])
        return Population(self.template, rows)

    # -- what it holds -------------------------------------------------------------

    def __len__(self) -> int:
        backing = self._backing
        return backing.count if isinstance(backing, _Generated) else len(backing.names)

    def __iter__(self) -> Iterator[str]:
        backing = self._backing
        if isinstance(backing, _Generated):
            return (f"{backing.prefix}{i}" for i in range(backing.count))
        return iter(backing.names)

    def __contains__(self, name: object) -> bool:
        backing = self._backing
        if isinstance(backing, _Generated):
            return backing.index(name) is not None
        return name in backing.index

    def __repr__(self) -> str:
        backing = self._backing
        where = backing.source if isinstance(backing, _Rows) else "a generator"
        return f"Population({len(self)} agents from {where})"

    def index(self, name: str) -> int:
        """The position of agent ``name`` (0 for the first).

        Raises:
            KeyError: no such agent.
        """
        backing = self._backing
        found = backing.index(name) if isinstance(backing, _Generated) else backing.index.get(name)
        if found is None:
            raise KeyError(name)
        return found

    def name_at(self, index: int) -> str:
        """The name of the agent at ``index``.

        Raises:
            IndexError: out of range.
        """
        backing = self._backing
        if isinstance(backing, _Rows):
            return backing.names[index]
        if not 0 <= index < backing.count:
            raise IndexError(index)
        return f"{backing.prefix}{index}"

    def params(self, name: str) -> dict[str, Any]:
        """Agent ``name``'s parameters (a new dict each time).

        Raises:
            KeyError: no such agent.
        """
        return self.params_at(self.index(name))

    def params_at(self, index: int) -> dict[str, Any]:
        """The parameters of the agent at ``index`` (a new dict each time).

        Raises:
            ConfigError: the generator gave something else than a mapping.
        """
        backing = self._backing
        if isinstance(backing, _Rows):
            return dict(zip(backing.columns, backing.rows[index], strict=True))
        if backing.fn is None:
            return {}
        made = backing.fn(index)
        if not isinstance(made, Mapping):
            raise ConfigError(
                f"the population's generator gave a {type(made).__name__} for agent {index}, "
                "not a mapping of parameters"
            )
        return dict(made)

    # -- building agents -----------------------------------------------------------

    def agent(self, name: str) -> Agent:
        """Build agent ``name``'s definition (cheap: call it as often as needed).

        Raises:
            KeyError: no such agent.
            ConfigError: its parameters do not fill the template, or its
                model cannot be configured.
        """
        index = self.index(name)
        params = self.params_at(index)
        prompt = self.system_prompt(name, params, index=index)
        return Agent(
            name,
            prompt,
            self.model_for(params),
            toolkit=self._toolkit,
            settings=self._agent_settings(),
            **{k: v for k, v in self.template.options.items() if k not in _TUNING},
        )

    def _agent_settings(self) -> AgentSettings:
        # Validated once, not once an agent: a host builds a definition per reply.
        if self._settings is None:
            self._settings = AgentSettings(
                max_iters=self.template.max_iters,
                model_calls=self._config(),
                **{k: v for k, v in self.template.options.items() if k in _TUNING},
            )
        return self._settings

    def system_prompt(self, name: str, params: Params, *, index: int = 0) -> str:
        """The template's system prompt filled for one agent.

        Raises:
            ConfigError: a placeholder the parameters do not have.
        """
        try:
            return self.template.system_prompt.format_map({**params, "name": name, "index": index})
        except (KeyError, IndexError, AttributeError, ValueError) as exc:
            raise ConfigError(f"the system prompt of {name!r} cannot be filled: {exc!r}") from exc

    def model_for(self, params: Params) -> ChatModel:
        """The model of an agent with these parameters: the override given to
        :meth:`bind`, else its ``model`` parameter, else its group's, else the
        template's, else the fleet's default.

        Raises:
            ConfigError: a model string that cannot be configured.
        """
        if self._override is not None:
            return self._model(self._override)
        own = params.get("model")
        if isinstance(own, str) and own.strip():
            return self._model(own.strip())
        group = params.get(self.template.group_by)
        chosen: str | ChatModel | None = self.template.model
        if group is not None and str(group) in self.template.models:
            chosen = self.template.models[str(group)]
        return self._resolve(chosen)

    def _resolve(self, chosen: str | ChatModel | None) -> ChatModel:
        if chosen is None:
            if self._default is None:
                self._default = default_model(bus=self._bus)
            return self._default
        return self._model(chosen) if isinstance(chosen, str) else chosen

    def _model(self, text: str) -> ChatModel:
        model = self._models.get(text)
        if model is None:
            model = model_from_string(text, bus=self._bus)
            self._models[text] = model
        return model

    def _config(self) -> ModelConfig:
        if self._model_config is None:
            self._model_config = default_model_config(bus=self._bus)
        return self._model_config

    def models(self) -> list[ChatModel]:
        """The distinct models the template names (its own, its groups', the
        override), resolved.

        Raises:
            ConfigError: one cannot be configured.
        """
        if self._override is not None:
            return [self._model(self._override)]
        out: list[ChatModel] = []
        for chosen in [self.template.model, *self.template.models.values()]:
            model = self._resolve(chosen)
            if all(model is not m for m in out):
                out.append(model)
        return out

    async def bind(
        self,
        bus: Bus,
        *,
        tools: Sequence[str] = (),
        model: str | None = None,
        wait: float = TOOL_WAIT,
        check: bool = True,
    ) -> list[str]:
        """Get ready to serve on ``bus``: the tools the agents use (the
        template's ``tools``, else ``tools``), waited for until served;
        ``bus:NAME`` models bound; every model checked once.

        Args:
            bus: the connection.
            tools: the tools of the simulation (used when the template names none).
            model: a model string for every agent (wins over the template).
            wait: seconds to wait for the tools to be served.
            check: check that each model can be reached.

        Returns:
            The names of the tools the agents get.

        Raises:
            ConfigError: a model cannot be configured or reached, or a tool is
                not served within ``wait`` seconds.
            BusError: discovery failed.
        """
        self._bus = bus
        self._override = model
        self._models.clear()
        self._default = None
        if self.template.model_config is None:
            self._model_config = None
        self._settings = None
        wanted = list(self.template.tools if self.template.tools is not None else tools)
        toolkit = Toolkit()
        if wanted:
            client = ToolClient(bus, sender=f"{bus.client_name}.tools")
            found = await _discover(client, wanted, wait, prefix=bus.prefix)
            for name in wanted:
                toolkit.add(RemoteToolProxy(found[name], client))
        self._toolkit = toolkit
        for chat_model in [*self.models(), self._config().fallback]:
            if isinstance(chat_model, BusModelRef) and chat_model.bus is None:
                chat_model.bind(bus)
        if check:
            for chat_model in self.models():
                await check_model(chat_model)
        return wanted

    def _check_params(self, params: Params, what: str) -> None:
        missing = [p for p in self.template.placeholders() if p not in params]
        if missing:
            raise ConfigError(
                f"{what} lack {', '.join(map(repr, missing))}, which the system prompt names"
            )


async def _discover(
    client: ToolClient, wanted: list[str], wait: float, *, prefix: str
) -> dict[str, Any]:
    """The remote tools ``wanted``, once every one is served (or ConfigError)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        found = await client.discover(timeout=0.3)
        missing = [n for n in wanted if n not in found]
        if not missing:
            return found
        if loop.time() >= deadline:
            raise ConfigError(
                f"no tool worker serves {', '.join(missing)} on prefix "
                f"{prefix!r} (waited {wait:g} s)"
            )
        await asyncio.sleep(0.1)


_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?(?:\d+\.\d*|\.\d+)(?:[eE][-+]?\d+)?|-?\d+[eE][-+]?\d+")


def _number(text: str | None) -> Any:
    """A CSV cell: an int or a float when it reads as one, else the text."""
    if text is None:
        return None
    stripped = text.strip()
    if _INT.fullmatch(stripped):
        return int(stripped)
    if _FLOAT.fullmatch(stripped):
        return float(stripped)
    return text


def _json_lines(path: Path) -> list[Params]:
    rows: list[Params] = []
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise ConfigError(f"{path}: line {number} is not JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise ConfigError(f"{path}: line {number} is not a JSON object")
            rows.append(row)
    return rows
