"""Range checks of values given in code, by pydantic constraints: one helper
for every layer that takes numbers from its callers (models, tool workers,
capabilities)."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from fleetbus.errors import ConfigError
from fleetbus.protocol.codec import clip

__all__ = ["check_ranges"]

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
