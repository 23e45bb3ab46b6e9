#!/usr/bin/env bash
# The package as users install it: builds the wheel, installs it into a fresh environment (.venv-wheel) with the
# transformers release the test suite does not run (SMOKE_TRANSFORMERS, default 5.24.0: the suite runs the newest),
# and runs scripts/smoke_installed.py from outside the checkout (imports, CLI entry points, quickstart, plan, serve,
# TRL SFT). About 4 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"${PYTHON:-python3}" -m pip wheel -q --no-deps -w "$work/dist" . 2> >(grep -v "^WARNING: Location" >&2)
rm -rf build .venv-wheel
"${PYTHON:-python3}" -m venv .venv-wheel
.venv-wheel/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" 2> >(grep -v "^WARNING: Location" >&2)
.venv-wheel/bin/python -m pip install -q "$work"/dist/kimi_hf-*.whl "transformers[serving]==${SMOKE_TRANSFORMERS:-5.24.0}" \
    "trl>=1.16" 2> >(grep -v "^WARNING: Location" >&2)
cd "$work"
"$root/.venv-wheel/bin/python" "$root/scripts/smoke_installed.py"
