#!/usr/bin/env bash
# Make sure headless Chromium is installed (Debian's `chromium` package): tests/test_show.py takes a
# screenshot of the `marslm show --html` page with it. Does nothing when it is already there.
# Needs root (or passwordless sudo) for apt-get; CI runs as root.
set -euo pipefail

if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo -n"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
command -v chromium >/dev/null
