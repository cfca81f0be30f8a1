#!/usr/bin/env bash
# Builds a base image for deploy/Dockerfile without an image registry: a minimal Debian with
# python3 and its venv module, made by debootstrap from the Debian mirror this machine's apt
# already uses, then `docker import`ed. Run as root.
#
#   deploy/base-image.sh [IMAGE]        (default swarmd-base:local)
#
# Environment: SWARMD_BASE_SUITE (default bookworm: Python 3.11, the Python of the wheels that
# setup-docker.sh downloads must match it), SWARMD_BASE_MIRROR (default: the first Debian
# mirror in /etc/apt/sources.list*, else http://deb.debian.org/debian).
set -euo pipefail

image=${1:-swarmd-base:local}
suite=${SWARMD_BASE_SUITE:-bookworm}

mirror=${SWARMD_BASE_MIRROR:-}
if [ -z "$mirror" ]; then
    # One-line (deb URL suite) and deb822 (URIs: URL) formats; the security archive holds
    # only updates, not a whole suite.
    mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
                 /etc/apt/sources.list.d/*.sources 2>/dev/null \
             | grep -oE '^(deb|URIs:)[[:space:]]+(\[[^]]*\][[:space:]]+)?https?://[^[:space:]]+' \
             | grep -oE 'https?://[^[:space:]]+' | grep -E '/debian/?$' | head -n 1 || true)
    mirror=${mirror:-http://deb.debian.org/debian}
fi

rootfs=$(mktemp -d /tmp/swarmd-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT

echo "base-image: debootstrap $suite from $mirror"
# minbase: essential packages and apt only; python3-venv brings ensurepip (pip for venvs).
debootstrap --variant=minbase --include=python3,python3-venv "$suite" "$rootfs" "$mirror" \
    > "$rootfs.log" 2>&1 || { tail -n 30 "$rootfs.log" >&2; exit 1; }
rm -f "$rootfs.log"
# Package caches are dead weight in an image.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*

tar -C "$rootfs" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$image" > /dev/null
echo "base-image: $image ($(docker run --rm "$image" python3 --version))"
