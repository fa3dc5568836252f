#!/usr/bin/env bash
# Make sure a Docker engine answers and `docker compose` (Compose v2) works:
# `make test-compose` (tests/compose/) runs docker-compose.yml with them.
#
# As root on Debian, what is missing is installed from Debian's packages:
# docker.io (the engine and the CLI) with apt-get; Compose v2 is Debian's
# docker-compose package from trixie (13) on, so on an older release the
# plugin binary is taken from trixie's package, fetched with apt-get through
# a source list of its own (the machine's apt sources are left as they are)
# and unpacked into /usr/local/lib/docker/cli-plugins. When no engine answers,
# dockerd is started in the background, its log in /var/log/fleetbus-dockerd.log.
# Elsewhere (not root, no apt-get) it says what is missing and exits 1.
set -euo pipefail

say() { echo "ensure-docker: $*"; }
fail() { say "$*" >&2; exit 1; }

can_install() { [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; }

apt_updated=""
apt_install() {
    if [ -z "$apt_updated" ]; then
        say "apt-get update"
        apt-get update -qq
        apt_updated=1
    fi
    say "apt-get install -y $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
}

# The URI of the machine's Debian archive (not its security archive).
debian_mirror() {
    if [ -n "${DEBIAN_MIRROR:-}" ]; then
        echo "$DEBIAN_MIRROR"
        return
    fi
    local uri
    uri="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }' \
        | grep -v -- '-security' | head -n 1 || true)"
    if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
        uri="$(awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++)
            if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' /etc/apt/sources.list)"
    fi
    [ -n "$uri" ] || fail "no Debian archive in the apt sources; set DEBIAN_MIRROR"
    echo "$uri"
}

# Compose v2 from trixie's docker-compose package, unpacked (not installed).
compose_from_trixie() {
    local work mirror deb
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    chmod 755 "$work" # apt-get downloads as the _apt user
    mirror="$(debian_mirror)"
    mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/parts"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" \
        >"$work/sources.list"
    local opts=(
        -o "Dir::Etc::SourceList=$work/sources.list"
        -o "Dir::Etc::SourceParts=$work/parts"
        -o "Dir::State::Lists=$work/lists"
        -o "Dir::Cache=$work/cache"
    )
    say "fetching trixie's docker-compose package (Compose v2)"
    apt-get "${opts[@]}" update -qq
    (cd "$work" && apt-get "${opts[@]}" download docker-compose >/dev/null)
    deb="$(ls "$work"/docker-compose_*.deb)"
    dpkg-deb -x "$deb" "$work/root"
    mkdir -p /usr/local/lib/docker/cli-plugins
    install -m 0755 "$(find "$work/root" -path '*/cli-plugins/docker-compose' | head -n 1)" \
        /usr/local/lib/docker/cli-plugins/docker-compose
    say "installed $(basename "$deb")'s plugin in /usr/local/lib/docker/cli-plugins"
}

if ! command -v docker >/dev/null 2>&1 || ! command -v dockerd >/dev/null 2>&1; then
    can_install || fail "no docker engine here: install Docker (the engine and Compose v2)"
    apt_install docker.io
fi

if ! docker compose version >/dev/null 2>&1; then
    can_install || fail "'docker compose' does not work: install the Compose v2 plugin"
    candidate="$(apt-cache policy docker-compose 2>/dev/null | awk '/Candidate:/ { print $2 }')"
    if [ -n "$candidate" ] && [ "${candidate%%.*}" -ge 2 ] 2>/dev/null; then
        apt_install docker-compose
    else
        compose_from_trixie
    fi
    docker compose version >/dev/null || fail "'docker compose' still does not work"
fi

if ! docker info >/dev/null 2>&1; then
    [ "$(id -u)" -eq 0 ] || fail "no Docker engine answers, and not root to start dockerd"
    say "starting dockerd (log: /var/log/fleetbus-dockerd.log)"
    nohup dockerd >>/var/log/fleetbus-dockerd.log 2>&1 &
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    docker info >/dev/null 2>&1 || fail "dockerd did not answer in 60 s: /var/log/fleetbus-dockerd.log"
fi

say "$(docker version --format 'engine {{.Server.Version}}, CLI {{.Client.Version}}'), $(docker compose version)"
