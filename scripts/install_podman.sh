#!/usr/bin/env bash
# A container runtime for the compose tests (pytest -m compose, tests/compose/): podman and runc from
# apt, podman-compose into .venv (pip), and the podman settings a VM without systemd needs. Idempotent;
# each step says how long it took. --optional: warn and exit 0 where it cannot (not root, no apt),
# so that the tests then skip with the reason.
#
# Settings written to /etc/containers/containers.conf only when that file does not exist (measured on
# this kind of machine, ENVIRONMENT.md "Containers"): default_ulimits = [] (the VM refuses podman's
# default nofile/nproc limits), the cgroupfs cgroup manager and runc when systemd is not PID 1 (no
# systemd to create scopes). Podman's healthchecks are systemd timers, so without systemd they never run
# by themselves: the compose tests run them with `podman healthcheck run`.
set -euo pipefail
cd "$(dirname "$0")/.."
OPTIONAL=0
[ "${1:-}" = --optional ] && OPTIONAL=1
fail() {
  if [ "$OPTIONAL" = 1 ]; then echo "install_podman: warning: $*" >&2; exit 0; fi
  echo "install_podman: $*" >&2
  exit 1
}
t0=$(date +%s)
say() { echo "install_podman: $* ($(( $(date +%s) - t0 )) s)" >&2; }

if ! command -v podman > /dev/null || ! command -v runc > /dev/null; then
  { [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; } || fail "podman is missing and apt-get cannot install it here (not root or no apt)"
  say "apt-get install podman runc"
  apt-get install -y -q podman runc > /tmp/install-podman.log 2>&1 ||
    { apt-get update -q > /dev/null 2>&1 && apt-get install -y -q podman runc > /tmp/install-podman.log 2>&1; } ||
    fail "apt-get install podman runc failed (log: /tmp/install-podman.log)"
fi
conf=/etc/containers/containers.conf
if [ ! -e "$conf" ] && [ "$(id -u)" = 0 ]; then
  if [ "$(ps -p 1 -o comm= 2>/dev/null)" = systemd ]; then engine=""; else
    engine=$'\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n'; fi
  mkdir -p /etc/containers
  printf '# scripts/install_podman.sh\n[containers]\ndefault_ulimits = []\n%s' "$engine" > "$conf"
  say "wrote $conf"
fi
if ! .venv/bin/python -c 'import podman_compose' 2>/dev/null; then
  say "pip install podman-compose into .venv"
  .venv/bin/python -m pip install --disable-pip-version-check -q 'podman-compose>=1.6' > /tmp/install-podman-compose.log 2>&1 ||
    fail "pip install podman-compose failed (log: /tmp/install-podman-compose.log)"
fi
if ! out=$(timeout 120 podman run --rm --pull never "${EI_PODMAN_PROBE_IMAGE:-localhost/evolving-base:bookworm}" true 2>&1); then
  if ! podman image inspect "${EI_PODMAN_PROBE_IMAGE:-localhost/evolving-base:bookworm}" > /dev/null 2>&1; then
    say "podman $(podman --version | awk '{print $3}') installed (no image yet to try a container with: bash deploy/build-images.sh)"
    exit 0
  fi
  fail "podman cannot run a container here: $(echo "$out" | tail -3)"
fi
say "podman $(podman --version | awk '{print $3}') runs containers; $(.venv/bin/podman-compose --version 2>/dev/null | head -1)"
