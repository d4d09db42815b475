#!/usr/bin/env bash
# Installs the independent checkers the grammar validation test runs its
# generated outputs through, from npm into one folder outside the tracked
# source tree. Idempotent. Never commit what it installs.
#
#   scripts/setup_grammar_refs.sh [DIR]   # default: build/grammar-refs
# Prints the folder holding node_modules.
#
# - ajv (draft 2020-12 through ajv/dist/2020) and ajv-formats (`format`):
#   the JSON-schema validator of record, independent of services/grammar.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-${PDSERVE_GRAMMAR_REFS_DIR:-build/grammar-refs}}"
PACKAGES=(
  ajv@8.17.1
  ajv-formats@3.0.1
)
exec scripts/install_npm_packages.sh setup_grammar_refs "$DIR" "${PACKAGES[@]}"
