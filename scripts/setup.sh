#!/usr/bin/env bash
# Creates .venv (once) and installs kimi_hf (editable) with its test extras.
# torch is installed first and pinned (TORCH_SPEC, default the CPU build 2.13.0 that this kind of
# machine keeps on disk): an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".[test]"
