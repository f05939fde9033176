# Sourced by the GPU scripts (gpu-e2e, gpu-sparse-attention, gpu-tp, gpu-rank-slice), which
# run from the project's root against the Python environment they are started in: `python3`
# and the vLLM, FlashInfer and torch it imports (a venv, the project's image, or a directory
# an environment hook puts on PYTHONPATH).
#
#   source "$(dirname "$0")/gpu-env.sh" NAME --vllm VERSION... --capability X.Y...
#
# 1. VLLM_MINIMAX_GPU_ENV_HOOK, when set, names a bash file sourced first, in the script's own
#    shell: what it exports (PYTHONPATH, PATH, ...) reaches every later command. It is where a
#    machine's own staging plugs in (on a machine without a package registry, say, one that
#    unpacks vLLM into a directory and puts that on PYTHONPATH); it lives outside the
#    repository. A hook that returns non-zero stops the script: exit 3.
# 2. This checkout goes first on PYTHONPATH: `python3 -m vllm_minimax` is this checkout's.
# 3. scripts/gpu_env_check.py checks vLLM (one of the versions), this checkout's series for it
#    (applied, or applying cleanly), FlashInfer and the GPU's compute capability, and names
#    whatever is missing in one line: exit 3.
# 4. scripts/ensure-series-applied leaves that vLLM with this checkout's series applied, as
#    `vllm-minimax apply` with no --target does: exit 4 when it cannot.
#
# Sourced rather than called, so that the hook runs as if the script sourced it itself. Sets
# `site`, the directory that holds the `vllm` package python3 imports (where the series is
# applied), and `vllm_version`.
gpu_env_name=$1
shift
if [ "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)" != "$(pwd -P)" ]; then
    echo "$gpu_env_name: run it from the project's root, as scripts/$gpu_env_name" >&2
    exit 2
fi
if [ -n "${VLLM_MINIMAX_GPU_ENV_HOOK:-}" ]; then
    if [ ! -f "$VLLM_MINIMAX_GPU_ENV_HOOK" ]; then
        echo "$gpu_env_name: VLLM_MINIMAX_GPU_ENV_HOOK=$VLLM_MINIMAX_GPU_ENV_HOOK is not a file" >&2
        exit 3
    fi
    # shellcheck disable=SC1090
    source "$VLLM_MINIMAX_GPU_ENV_HOOK" || {
        gpu_env_status=$?
        echo "$gpu_env_name: the environment hook $VLLM_MINIMAX_GPU_ENV_HOOK returned" \
            "$gpu_env_status" >&2
        exit 3
    }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
gpu_env_facts=$(python3 scripts/gpu_env_check.py "$gpu_env_name" "$@") || exit 3
{ read -r site; read -r vllm_version; read -r gpu_env_summary; } <<< "$gpu_env_facts"
echo "$gpu_env_summary"
scripts/ensure-series-applied "$site" || exit 4
