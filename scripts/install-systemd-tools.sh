#!/usr/bin/env bash
# Installs what tests/test_systemd_units.py needs (`systemd-analyze verify`) on a fresh
# Debian machine. Idempotent: does nothing when the tool is already there. Runs as root
# (CI does), or through sudo when it is available.
set -euo pipefail

if command -v systemd-analyze >/dev/null 2>&1; then
    echo "install-systemd-tools: systemd-analyze already installed ($(systemd-analyze --version | head -n1)); nothing to do"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-systemd-tools: apt-get not found; install the package that provides systemd-analyze by hand" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-systemd-tools: must run as root (or with sudo available) to apt-get install systemd" >&2
        exit 1
    fi
fi

# The `systemd` package carries systemd-analyze and the stock units (sysinit.target,
# basic.target, ...) that verify resolves our units' default dependencies against.
# Installing it into a container does not start it; postinst scripts only register units.
echo "install-systemd-tools: apt-get update"
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
echo "install-systemd-tools: apt-get -y --no-install-recommends install systemd"
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get -y -q --no-install-recommends install systemd
echo "install-systemd-tools: installed $(systemd-analyze --version | head -n1)"
