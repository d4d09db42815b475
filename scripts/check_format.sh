#!/usr/bin/env bash
# Fails if any C++ source differs from clang-format (Google style, .clang-format).
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' 2>/dev/null || true)
if ((${#files[@]} == 0)); then exit 0; fi
if ! clang-format --dry-run --Werror "${files[@]}" 2>/tmp/pdserve-format.log; then
  echo "clang-format: these files need formatting (run: clang-format -i FILE):"
  grep -o '^[^:]*' /tmp/pdserve-format.log | sort -u
  exit 1
fi
echo "format: ${#files[@]} files clean"
