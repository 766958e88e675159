#!/usr/bin/env bash
# Build the Python base image of deploy/Dockerfile from Debian packages, for machines that reach a
# Debian mirror but no image registry (`FROM python:3.11-slim` cannot be pulled there):
#
#   bash deploy/build-base.sh                       # -> localhost/evolving-base:bookworm
#   podman build --build-arg BASE_IMAGE=localhost/evolving-base:bookworm -f deploy/Dockerfile .
#
# debootstrap's minbase variant (Debian's essential packages) plus Python 3.11 with venv,
# ca-certificates and libibverbs1 (Mooncake imports it), imported as a one-layer image. The mirror
# is the machine's own (its apt sources) unless EI_DEBIAN_MIRROR names one; EI_DEBIAN_SUITE
# (bookworm: Python 3.11) and EI_CONTAINER_RUNTIME (podman, else docker) can be set too. Needs root
# (debootstrap); installs debootstrap with apt-get when it is missing.
set -euo pipefail
IMAGE=${1:-localhost/evolving-base:bookworm}
SUITE=${EI_DEBIAN_SUITE:-bookworm}
PACKAGES=python3,python3-venv,ca-certificates,libibverbs1

t0=$(date +%s)
say() { echo "build-base: $* ($(( $(date +%s) - t0 )) s)" >&2; }
if [ "$(id -u)" != 0 ]; then
  echo "build-base: debootstrap needs root" >&2
  exit 1
fi
RUNTIME=${EI_CONTAINER_RUNTIME:-$(command -v podman || command -v docker || true)}
if [ -z "$RUNTIME" ]; then
  echo "build-base: no podman or docker (apt-get install -y podman)" >&2
  exit 1
fi
if ! command -v debootstrap > /dev/null; then
  say "apt-get install debootstrap"
  apt-get install -y -q debootstrap > /dev/null
fi
# The first Debian archive of the machine's apt sources (deb822 .sources files or sources.list).
machine_mirror() {
  { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
    grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}'
  } | grep -v -- '-security' | grep '/debian/\?$' | head -n 1 || true
}
MIRROR=${EI_DEBIAN_MIRROR:-$(machine_mirror)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
say "debootstrap --variant=minbase --include=$PACKAGES $SUITE from $MIRROR"
if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" > "$rootfs.log" 2>&1; then
  tail -20 "$rootfs.log" >&2
  echo "build-base: debootstrap failed (log: $rootfs.log)" >&2
  exit 1
fi
rm -f "$rootfs.log"
# no package cache or lists in the image; apt-get update works again inside a build
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
say "importing $(du -sh "$rootfs" | cut -f1) into $RUNTIME as $IMAGE"
tar -C "$rootfs" -c . | "$RUNTIME" import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$IMAGE" > /dev/null
"$RUNTIME" run --rm "$IMAGE" python3 -c 'import sys, venv, ssl; print("build-base: python", sys.version.split()[0])' >&2
say "$IMAGE ready"
