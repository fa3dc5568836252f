"""Range checks of values given in code, by pydantic constraints: one helper
for every layer that takes numbers from its callers (models, tool workers,
capabilities); and settings read from the environment with values given
over them (the commands', the gateway's)."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from fleetbus.errors import ConfigError
from fleetbus.protocol.codec import clip

__all__ = ["check_ranges", "settings_from"]

_Limits = TypeVar("_Limits", bound=BaseModel)


def check_ranges(
    limits: type[_Limits], where: str, error: type[Exception] = ConfigError, **values: Any
) -> _Limits:
    """``limits(**values)``: the values, checked against the constraints the
    fields of ``limits`` declare (``Field(ge=…)``).

    Args:
        limits: a pydantic model whose fields are the values' names.
        where: what takes the values, named in the error (``"coding_tools"``).
        error: the exception raised for a value out of range.
        values: the values, by field name.

    Raises:
        ConfigError: (or ``error``) the first value out of range, named with
            what was given.
    """
    try:
        return limits(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(part) for part in first["loc"])
        raise error(
            f"{where}: {name}: {first['msg']}, not {clip(repr(first['input']), 80)}"
        ) from None


def settings_from(settings: type[_Limits], env_prefix: str, **given: Any) -> _Limits:
    """``settings(**given)``: the values given (``None``: not given) over the
    environment (``<env_prefix><FIELD>``), over the defaults.

    Raises:
        ConfigError: a value is invalid; the message names its variable (or
            its field, for a value given here).
    """
    values = {name: value for name, value in given.items() if value is not None}
    try:
        return settings(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        where = field if field in values else f"{env_prefix}{field.upper()}"
        raise ConfigError(f"{where}: {first['msg']}") from exc
