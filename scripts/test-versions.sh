#!/usr/bin/env bash
# Run the tests against the lowest or the newest versions pyproject.toml allows.
#
#   scripts/test-versions.sh lowest [pytest args…]   # .venv-lowest: every runtime
#                                                    # dependency at its lower bound
#   scripts/test-versions.sh newest [pytest args…]   # .venv-newest: the newest allowed
#
# "lowest" pins each `>=` bound of `[project] dependencies` and of the `otel`
# extra to `==` that bound (a constraints file); test tools are installed at
# their newest. Without pytest arguments the whole suite runs (`pytest -n 4`).
# The venvs are kept between runs; `FLEETBUS_REBUILD=1` makes them anew.
set -euo pipefail
cd "$(dirname "$0")/.."

which="${1:-}"
case "$which" in
    lowest | newest) shift ;;
    *)
        echo "usage: $0 lowest|newest [pytest arguments]" >&2
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
print(json.dumps([project["dependencies"], extras["otel"], extras["dashboard"]]))
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
    if sys.argv[1] != "lowest":
        break
    match = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?\s*>=\s*([0-9][^,;\s]*)", requirement)
    if match is None:
        sys.exit(f"no lower bound in {requirement!r}")
    print(f"{match[1]}=={match[2]}")
EOF
    upgrade=()
    if [[ "$which" == newest ]]; then
        upgrade=(--upgrade --upgrade-strategy eager)
    fi
    "$venv/bin/python" -m pip install --quiet "${upgrade[@]}" -c "$constraints" \
        -e '.[otel,dashboard]' \
        'pytest>=8' 'pytest-asyncio>=0.24' 'pytest-timeout>=2.3' 'pytest-xdist>=3.5' \
        'hypothesis>=6.100' 'cryptography>=42' 'jsonschema>=4.21'
    printf '%s' "$requirements" >"$stamp"
fi

echo "== $which: $("$venv/bin/python" -m pip list --format=freeze 2>/dev/null |
    grep -iE '^(nats-py|opentelemetry-(api|sdk)|msgspec|pydantic|pydantic-settings)==' |
    tr '\n' ' ')"
"$venv/bin/python" -m compileall -q fleetbus tests
if [[ $# -eq 0 ]]; then
    set -- -n 4
fi
exec "$venv/bin/pytest" "$@"
