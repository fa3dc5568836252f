"""A benchmark's JSON line: printed, and appended to a results file when given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(line: dict[str, Any], results: Path | None) -> None:
    """Print ``line`` as one compact JSON line; append it to ``results`` too."""
    text = json.dumps(line, separators=(",", ":"))
    print(text, flush=True)
    if results is not None:
        with results.open("a") as out:
            out.write(text + "\n")
