#!/usr/bin/env bash
# Set up and run the demo job: a tiny Qwen3-shaped model fine-tuned on CPU with 2 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/slidedp-launch examples/tiny.toml --set run.overwrite=true "$@"  # re-runnable: replaces runs/tiny
