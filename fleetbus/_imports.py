"""Importing the modules a command line names (``mytools``, ``pkg.agents``).

``python -m fleetbus`` puts the working directory first on ``sys.path``; the
``fleetbus`` script does not (its own directory comes first). So that
``fleetbus worker mytools`` finds ``./mytools.py`` as ``python -m`` would, the
working directory is added before a named module is imported (as uvicorn and
celery do for the application they are given).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

__all__ = ["import_named"]


def import_named(name: str) -> ModuleType:
    """Import module ``name``, looking in the working directory too.

    Raises:
        ImportError: as :func:`importlib.import_module` does.
    """
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
        importlib.invalidate_caches()
    return importlib.import_module(name)
