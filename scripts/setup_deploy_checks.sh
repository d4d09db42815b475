#!/usr/bin/env bash
# Installs the npm packages the Kubernetes manifest checks need
# (scripts/check_manifests.mjs) into one folder, outside the source tree's
# tracked files. Idempotent: npm runs only when a pinned version is missing.
#
#   scripts/setup_deploy_checks.sh [DIR]     # default: build/deploy-checks
# Prints the folder holding node_modules.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-${PDSERVE_DEPLOY_CHECKS_DIR:-build/deploy-checks}}"
PACKAGES=(
  kubernetes-models@5.1.0
  @kubernetes-models/prometheus-operator@6.0.0
  js-yaml@4.1.0
  fast-json-patch@3.1.1
)
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  # Machines that have node bring npm with it (nodesource); a bare Debian
  # needs both packages.
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  { $SUDO apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
      --no-install-recommends nodejs npm; } >/dev/null 2>&1 || {
    echo "setup_deploy_checks: needs node and npm (apt-get install nodejs npm failed)" >&2
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
    echo "setup_deploy_checks: npm install failed (log: $log)" >&2
    exit 1
  fi
  rm -f "$log"
fi
echo "$DIR"
