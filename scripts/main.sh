#!/usr/bin/env bash
# The main job on its embedded default (CPU, offline, small): set up, then the KDA benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python benchmarks/kda.py --quick "$@"
