#!/usr/bin/env bash
# Installs pinned npm packages into DIR/node_modules, outside the tracked
# source tree: the shared body of scripts/setup_deploy_checks.sh and
# scripts/setup_tokenizer_refs.sh. Idempotent: npm runs only when a pinned
# version is missing; parallel tests take turns (flock). Installs node and
# npm from Debian when the machine has neither.
#
#   scripts/install_npm_packages.sh NAME DIR PACKAGE@VERSION...
# NAME prefixes error messages. Prints DIR.
set -euo pipefail
NAME="$1"
DIR="$2"
shift 2
PACKAGES=("$@")
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  # Machines that have node bring npm with it (nodesource); a bare Debian
  # needs both packages.
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  { $SUDO apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
      --no-install-recommends nodejs npm; } >/dev/null 2>&1 || {
    echo "$NAME: needs node and npm (apt-get install nodejs npm failed)" >&2
    exit 1
  }
fi
mkdir -p "$DIR"
# Tests run in parallel: one installer at a time.
exec 9>"$DIR/.install.lock"
flock 9
missing=0
for spec in "${PACKAGES[@]}"; do
  name="${spec%@*}"
  version="${spec##*@}"
  json="$DIR/node_modules/$name/package.json"
  if [ ! -f "$json" ] ||
     [ "$(node -p "require('./$json').version" 2>/dev/null)" != "$version" ]; then
    missing=1
  fi
done
if ((missing)); then
  log=$(mktemp /tmp/pdserve-npm.XXXXXX.log)
  if ! npm install --prefix "$DIR" --no-audit --no-fund --no-save \
       "${PACKAGES[@]}" >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    echo "$NAME: npm install failed (log: $log)" >&2
    exit 1
  fi
  rm -f "$log"
fi
echo "$DIR"
