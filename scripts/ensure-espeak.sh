#!/usr/bin/env bash
# Make sure the espeak-ng speech synthesizer exists: fleetbus.models.EspeakSpeech
# runs it, and the speech tests (tests/unit/test_speech.py,
# tests/integration/test_speech.py) measure the WAV files it writes.
#
# Installs Debian's `espeak-ng` package with apt-get when no espeak-ng is found
# and this runs as root on a machine with apt-get. Otherwise it says why it
# did nothing and exits 0: EspeakSpeech then raises a ConfigError naming the
# install command, and the speech tests that need the program skip.
set -euo pipefail

for candidate in "${FLEETBUS_ESPEAK:-}" espeak-ng; do
    if [ -n "$candidate" ] && found="$(command -v "$candidate" 2>/dev/null)"; then
        echo "ensure-espeak: found $found"
        exit 0
    fi
done

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-espeak: no espeak-ng and no apt-get here; install espeak-ng yourself" \
        "(or set FLEETBUS_ESPEAK to its path); speech will not work and its tests will be skipped"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "ensure-espeak: no espeak-ng, and not root: run 'sudo apt-get install -y espeak-ng'" \
        "for speech; its tests will be skipped"
    exit 0
fi

echo "ensure-espeak: apt-get update"
apt-get update -qq
echo "ensure-espeak: apt-get install -y espeak-ng"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends espeak-ng
echo "ensure-espeak: installed $(command -v espeak-ng)"
