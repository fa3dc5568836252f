#!/usr/bin/env bash
# Run the tests against the lowest or the newest versions pyproject.toml allows.
#
#   scripts/test-versions.sh lowest [pytest args…]   # .venv-lowest: nats-py and
#                                                    # OpenTelemetry at their lower bounds
#   scripts/test-versions.sh floor [pytest args…]    # .venv-floor: every runtime
#                                                    # dependency at its lower bound
#   scripts/test-versions.sh newest [pytest args…]   # .venv-newest: the newest allowed
#
# "lowest" pins the `>=` bounds of nats-py and OpenTelemetry (the libraries
# whose internals fleetbus reads, in fleetbus/bus/_seam.py and
# fleetbus/tracing.py) to `==` those bounds, the rest at their newest;
# "floor" pins each `>=` bound of `[project] dependencies` and of the `otel`
# extra (a constraints file). The test tools (the `dev` extra) are installed
# at their newest. Without pytest arguments the whole suite runs (`pytest -n
# 4`). The `mcp` extra is tested with "newest" only: mcp 2.3 needs pydantic
# 2.12 and opentelemetry-api 1.28, above the lowest the rest of fleetbus
# allows; "lowest" and "floor" leave it and its tests out.
# The venvs are kept between runs; `FLEETBUS_REBUILD=1` makes them anew.
set -euo pipefail
cd "$(dirname "$0")/.."

which="${1:-}"
case "$which" in
    lowest | floor | newest) shift ;;
    *)
        echo "usage: $0 lowest|floor|newest [pytest arguments]" >&2
        exit 2
        ;;
esac

PYTHON="${PYTHON:-$(for p in python3.11 python3.12 python3.13 python3; do
    command -v "$p" >/dev/null 2>&1 &&
        "$p" -c 'import sys; sys.exit(sys.version_info < (3, 11))' &&
        { command -v "$p"; break; }
done)}"
test -n "$PYTHON" || { echo "needs Python 3.11 or newer on PATH" >&2; exit 1; }

venv=".venv-$which"
stamp="$venv/.installed"
if [[ "${FLEETBUS_REBUILD:-}" == 1 ]]; then
    rm -rf "$venv"
fi
# The venv is made anew when the requirements it was built from change (not
# on any edit of pyproject.toml: its other sections change more often).
requirements="$("$PYTHON" - <<'EOF'
import json
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
extras = project["optional-dependencies"]
print(json.dumps([project["dependencies"], extras["otel"], extras["dashboard"], extras["dev"]]))
EOF
)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$requirements" ]]; then
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    constraints="$venv/constraints.txt"
    # The lower bound of each runtime dependency (and of the otel extra), as `==`.
    "$venv/bin/python" - "$which" >"$constraints" <<'EOF'
import re
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
requirements = project["dependencies"] + project["optional-dependencies"]["otel"]
for requirement in requirements:
    if sys.argv[1] == "newest":
        break
    match = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?\s*>=\s*([0-9][^,;\s]*)", requirement)
    if match is None:
        sys.exit(f"no lower bound in {requirement!r}")
    if sys.argv[1] == "lowest" and not re.match(r"nats-py$|opentelemetry-", match[1]):
        continue
    print(f"{match[1]}=={match[2]}")
EOF
    upgrade=()
    if [[ "$which" == newest ]]; then
        upgrade=(--upgrade --upgrade-strategy eager)
    fi
    dev="$venv/dev.txt"
    "$venv/bin/python" - "$which" >"$dev" <<'EOF'
import re
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
for requirement in project["optional-dependencies"]["dev"]:
    if sys.argv[1] != "newest" and re.match(r"mcp\b", requirement):
        continue
    print(requirement)
EOF
    "$venv/bin/python" -m pip install --quiet "${upgrade[@]}" -c "$constraints" \
        -e '.[otel,dashboard]' -r "$dev"
    printf '%s' "$requirements" >"$stamp"
fi

echo "== $which: $("$venv/bin/python" -m pip list --format=freeze 2>/dev/null |
    grep -iE '^(nats-py|opentelemetry-(api|sdk)|msgspec|pydantic|pydantic-settings)==' |
    tr '\n' ' ')"
"$venv/bin/python" -m compileall -q fleetbus tests
if [[ $# -eq 0 ]]; then
    set -- -n 4
    if [[ "$which" != newest ]]; then
        set -- "$@" --ignore-glob='tests/integration/test_mcp_*.py'
    fi
fi
exec "$venv/bin/pytest" "$@"
