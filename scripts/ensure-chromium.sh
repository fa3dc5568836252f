#!/usr/bin/env bash
# Make sure a Chromium binary exists for the dashboard's browser test
# (tests/integration/test_dashboard_browser.py drives it with Playwright).
#
# Installs Debian's `chromium` package with apt-get when no chromium is found
# and this runs as root on a machine with apt-get. Otherwise it says why it
# did nothing and exits 0: the browser test then skips with that reason.
set -euo pipefail

for candidate in "${FLEETBUS_CHROMIUM:-}" chromium chromium-browser; do
    if [ -n "$candidate" ] && found="$(command -v "$candidate" 2>/dev/null)"; then
        echo "ensure-chromium: found $found"
        exit 0
    fi
done

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-chromium: no chromium and no apt-get here; install Chromium yourself" \
        "(or set FLEETBUS_CHROMIUM); the browser test will be skipped"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "ensure-chromium: no chromium, and not root: run 'sudo apt-get install -y chromium'" \
        "to run the browser test; it will be skipped"
    exit 0
fi

echo "ensure-chromium: apt-get update"
apt-get update -qq
echo "ensure-chromium: apt-get install -y chromium"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
echo "ensure-chromium: installed $(command -v chromium)"
