#!/usr/bin/env bash
# Make sure bubblewrap is installed (Debian's `bubblewrap` package): marslm runs model-written code
# (the toy suite's code family, HumanEval) inside it (marslm/data/sandbox.py), and refuses to run that
# code without it unless told --unsafe-exec. Does nothing when it is already there.
# Needs root (or passwordless sudo) for apt-get; CI runs as root.
set -euo pipefail

if command -v bwrap >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo -n"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq bubblewrap >/dev/null
command -v bwrap >/dev/null
