#!/usr/bin/env bash
# Create .venv and install megapo with its CPU pins. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, alone: its pin picks the CPU wheel on disk instead of a multi-GB CUDA build.
.venv/bin/python -m pip install -q -c constraints.txt torch
.venv/bin/python -m pip install -q -c constraints.txt -e '.[test]'
echo "megapo installed in $(pwd)/.venv"
