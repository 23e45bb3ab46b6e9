#!/usr/bin/env bash
# The main job on its embedded default (CPU, offline, small; about 3 minutes on 2 cores): set up,
# then `kimi-hf quickstart` (build, train with MuonClip + Trainer, save, reload, generate). Extra
# arguments go to the quickstart, e.g. `bash scripts/main.sh --size tiny --steps 50 --out /tmp/qs`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kimi-hf quickstart "$@"
