#!/bin/sh
# The image's entry point: `swarmd-entrypoint ARGS...` runs `swarmd ARGS...`;
# `swarmd-entrypoint health` is the HEALTHCHECK.
#
# A peer tells others the address it listens on (matchmaking, state adverts), so it must not
# listen on 0.0.0.0: unless SWARMD_LISTEN is set, it listens on this container's own address
# on the network (what `hostname -i` resolves), port SWARMD_PORT (default 7000).
set -eu

if [ -z "${SWARMD_LISTEN:-}" ]; then
    # The first address: a container attached to one network has exactly one.
    ip=$(hostname -i | cut -d ' ' -f 1)
    SWARMD_LISTEN="$ip:${SWARMD_PORT:-7000}"
    export SWARMD_LISTEN
fi

if [ "${1:-}" = "health" ]; then
    # The standard grpc.health.v1 check on the peer port (served by join, dht and serve
    # alike); a throw-away identity, so the check never touches the state directory.
    exec swarmd ping --count 0 --timeout 10 "$SWARMD_LISTEN"
fi

exec swarmd "$@"
