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
  @kubernetes-models/keda@2.0.0
  js-yaml@4.1.0
  fast-json-patch@3.1.1
)
exec scripts/install_npm_packages.sh setup_deploy_checks "$DIR" "${PACKAGES[@]}"
