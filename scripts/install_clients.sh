#!/usr/bin/env bash
# Install the real coding agents the `clients` tests run against `evolving up` (issue 36 part 8;
# tests/integration/test_real_clients.py, docs/gateway.md "Real clients"):
#   - Claude Code, Codex CLI and opencode from npm, into .clients/node_modules (.clients/ is
#     gitignored; the binaries are .clients/node_modules/.bin/{claude,codex,opencode});
#   - mini-swe-agent from PyPI into its own virtual environment .clients/msa (its litellm and
#     datasets pull ~100 packages - pyarrow, pandas, aiohttp pins - that are kept out of .venv).
# Pinned versions, each checked after installing. Idempotent: a client already at its pinned
# version is not touched (no registry access at all when everything is in place).
#
# --optional: a missing Node/npm is a warning and exit 0 (scripts/test.sh uses this; the tests
# then skip with the reason), and so is a registry that cannot be reached; without it, both fail.
set -euo pipefail
cd "$(dirname "$0")/.."
OPTIONAL=0
for arg in "$@"; do
  case "$arg" in
    --optional) OPTIONAL=1 ;;
    *) echo "usage: bash scripts/install_clients.sh [--optional]" >&2; exit 2 ;;
  esac
done
# The versions the tests and docs/gateway.md's tables were measured with.
CLAUDE_CODE_VERSION=2.1.332
CODEX_VERSION=0.171.0
OPENCODE_VERSION=1.18.33
MINI_SWE_AGENT_VERSION=2.4.6
PREFIX=${EI_CLIENTS_DIR:-.clients}  # the tests read the same variable

fail() {
  if [ "$OPTIONAL" = 1 ]; then
    echo "warning: $1 (the clients tests will be skipped)" >&2
    exit 0
  fi
  echo "ERROR: $1" >&2
  exit 1
}

npm_version() {  # the installed version of an npm package under $PREFIX, or nothing
  node -e 'try { console.log(require(process.argv[1]).version) } catch (e) {}' \
    "$(cd "$PREFIX" && pwd)/node_modules/$1/package.json" 2>/dev/null || true
}

mkdir -p "$PREFIX"
if ! command -v node > /dev/null || ! command -v npm > /dev/null; then
  fail "node and npm are needed for Claude Code, Codex and opencode"
fi
want=()
for spec in "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION" \
            "opencode-ai@$OPENCODE_VERSION"; do
  pkg=${spec%@*}
  [ "$(npm_version "$pkg")" = "${spec##*@}" ] || want+=("$spec")
done
if [ "${#want[@]}" -gt 0 ]; then
  echo "installing ${want[*]} into $PREFIX (log: $PREFIX/install-npm.log) ..." >&2
  # $PREFIX/package.json records the pins (so installing one keeps the others); each package's
  # optionalDependencies bring its platform binary (Claude Code, Codex and opencode are native).
  if ! npm install --prefix "$PREFIX" --save-exact --no-audit --no-fund --loglevel=error "${want[@]}" \
       > "$PREFIX/install-npm.log" 2>&1; then
    tail -20 "$PREFIX/install-npm.log" >&2
    fail "npm install ${want[*]} failed (full log: $PREFIX/install-npm.log)"
  fi
  for bin in claude codex opencode; do  # what was just installed runs
    if ! "$PREFIX/node_modules/.bin/$bin" --version > /dev/null 2>&1; then
      fail "$PREFIX/node_modules/.bin/$bin does not run (see $PREFIX/install-npm.log)"
    fi
  done
fi
for spec in "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION" \
            "opencode-ai@$OPENCODE_VERSION"; do
  [ "$(npm_version "${spec%@*}")" = "${spec##*@}" ] || fail "${spec%@*} is not at ${spec##*@} in $PREFIX"
done

PY=${PYTHON:-python3}
msa_version() {
  "$PREFIX/msa/bin/python" -c 'import importlib.metadata as m; print(m.version("mini-swe-agent"))' 2>/dev/null || true
}
if [ "$(msa_version)" != "$MINI_SWE_AGENT_VERSION" ]; then
  echo "installing mini-swe-agent==$MINI_SWE_AGENT_VERSION into $PREFIX/msa (log: $PREFIX/install-msa.log) ..." >&2
  [ -x "$PREFIX/msa/bin/python" ] || "$PY" -m venv "$PREFIX/msa"
  if ! "$PREFIX/msa/bin/python" -m pip install --disable-pip-version-check -q \
       "mini-swe-agent==$MINI_SWE_AGENT_VERSION" > "$PREFIX/install-msa.log" 2>&1; then
    tail -20 "$PREFIX/install-msa.log" >&2
    fail "pip install mini-swe-agent==$MINI_SWE_AGENT_VERSION failed (full log: $PREFIX/install-msa.log)"
  fi
fi
[ "$(msa_version)" = "$MINI_SWE_AGENT_VERSION" ] || fail "mini-swe-agent==$MINI_SWE_AGENT_VERSION is not in $PREFIX/msa"
echo "clients: claude $(npm_version @anthropic-ai/claude-code), codex $(npm_version @openai/codex)," \
     "opencode $(npm_version opencode-ai), mini-swe-agent $(msa_version) in $PREFIX" >&2
