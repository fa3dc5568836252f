"""The cycle collector tuned for serving processes."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from fleetbus.bus import GC_THRESHOLD, tune_gc
from fleetbus.errors import ConfigError


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)
    gc.unfreeze()


def test_the_default_threshold_is_set_and_the_heap_so_far_frozen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FLEETBUS_GC_THRESHOLD", raising=False)
    gc.unfreeze()
    second, third = gc.get_threshold()[1:]
    assert tune_gc() == GC_THRESHOLD
    assert gc.get_threshold() == (GC_THRESHOLD, second, third)
    assert gc.get_freeze_count() > 0


def test_the_environment_sets_it_and_zero_leaves_python_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEETBUS_GC_THRESHOLD", "5000")
    assert tune_gc() == 5000
    assert gc.get_threshold()[0] == 5000
    gc.set_threshold(700, 10, 10)
    monkeypatch.setenv("FLEETBUS_GC_THRESHOLD", "0")
    assert tune_gc() == 0
    assert gc.get_threshold() == (700, 10, 10)
    assert tune_gc(1234) == 1234  # an argument wins over the environment


@pytest.mark.parametrize("value", ["lots", "-5", "1.5"])
def test_a_bad_setting_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("FLEETBUS_GC_THRESHOLD", value)
    with pytest.raises(ConfigError, match=r"at least 0|whole number"):
        tune_gc()
