#!/usr/bin/env bash
# Prepares this machine for deploy/Dockerfile and tests/multinode/ (compose and netns), without an
# image registry: installs docker and docker-compose, starts dockerd, builds the base image
# (deploy/base-image.sh), downloads the wheels the image installs offline into deploy/wheels,
# and builds the image once so a later build is a cache hit. Idempotent; run as root from
# anywhere. Prints how long each step took.
#
# Environment: SWARMD_BASE_IMAGE (default swarmd-base:local), SWARMD_IMAGE (default
# swarmd:local), TORCH (default torch==2.13.0), PYTHON (runs pip download; default the
# repository's .venv, else python3).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
base=${SWARMD_BASE_IMAGE:-swarmd-base:local}
image=${SWARMD_IMAGE:-swarmd:local}
torch=${TORCH:-torch==2.13.0}
python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then python=$repo/.venv/bin/python; else python=python3; fi
fi

step_start=0
step() { step_start=$(date +%s); echo "setup-docker: $*"; }
done_step() { echo "setup-docker:   done in $(( $(date +%s) - step_start ))s"; }

step "packages (docker.io docker-compose debootstrap, iproute2 for the netns test)"
if ! command -v dockerd > /dev/null || ! command -v docker-compose > /dev/null \
        || ! command -v debootstrap > /dev/null || ! command -v ip > /dev/null \
        || ! command -v tc > /dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq docker.io docker-compose debootstrap iproute2 > /dev/null
fi
done_step

step "dockerd"
if ! docker info > /dev/null 2>&1; then
    # No init system to ask on these machines: run it in the background, logging to a file.
    nohup dockerd > /var/log/dockerd.log 2>&1 &
    for _ in $(seq 120); do
        docker info > /dev/null 2>&1 && break
        sleep 0.5
    done
    docker info > /dev/null 2>&1 || { tail -n 20 /var/log/dockerd.log >&2; exit 1; }
fi
done_step

step "base image $base"
if ! docker image inspect "$base" > /dev/null 2>&1; then
    "$repo/deploy/base-image.sh" "$base"
fi
done_step

step "wheels for $base in deploy/wheels"
# The wheels must fit the base image's Python, not this machine's.
pyver=$(docker run --rm "$base" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
mapfile -t deps < <("$python" -c 'import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("torch")))' "$repo/pyproject.toml")
platforms=(--platform manylinux2014_x86_64 --platform linux_x86_64)
for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
# The image builds swarmd itself with setuptools and wheel, offline.
if ! out=$("$python" -m pip download -q --disable-pip-version-check -d "$repo/deploy/wheels" \
        --only-binary=:all: --python-version "$pyver" --implementation cp "${platforms[@]}" \
        "$torch" "${deps[@]}" "setuptools>=68" wheel 2>&1); then
    echo "$out" >&2
    exit 1
fi
done_step

step "image $image (later builds with the same arguments hit this cache)"
docker build -q -f "$repo/deploy/Dockerfile" --build-arg BASE_IMAGE="$base" \
    --build-arg PIP_ARGS=--no-index --build-arg TORCH="$torch" -t "$image" "$repo" > /dev/null
done_step
