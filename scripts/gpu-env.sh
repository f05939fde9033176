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
#    whatever is missing in one line: exit 3. It also refuses a vLLM outside the virtual
#    environment python3 runs in (a user's own install; as root, the system's site-packages)
#    unless VLLM_MINIMAX_GPU_TARGET names its directory (the one holding `vllm/`), as a
#    machine that stages vLLM with `pip install --target DIR` must: VLLM_MINIMAX_GPU_TARGET=DIR.
# 4. scripts/gpu_site_restore.py records the tree as found, and scripts/ensure-series-applied
#    leaves that vLLM with this checkout's series applied, as `vllm-minimax apply` with no
#    --target does: exit 4 when it cannot.
# 5. On exit (INT, TERM and HUP included), when step 4 wrote the tree, the tree is put back
#    as found: this checkout's series reverted, and another revision's files and state file
#    written back if one was applied. A restore that fails makes the exit status 4 (unless
#    the script failed already) and leaves the record, whose path it names. A phase that
#    leaves work running after it exits (gpu-rank-slice's detached rounds) takes the restore
#    over: it sets gpu_env_restore_file empty and runs the restore when the work ends.
#    A script that needs its own EXIT trap calls gpu_env_restore from it.
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
gpu_env_root=$PWD
gpu_env_restore_file=

# gpu_env_restore: puts the tree back as step 4 found it, once; non-zero when it cannot.
gpu_env_restore() {
    [ -n "${gpu_env_restore_file:-}" ] || return 0
    local record=$gpu_env_restore_file
    gpu_env_restore_file=
    if [ ! -s "$record" ]; then
        rm -f "$record"
        return 0
    fi
    if python3 "$gpu_env_root/scripts/gpu_site_restore.py" restore "$record"; then
        rm -f "$record"
    else
        echo "gpu-env: $site was not put back; python3 scripts/gpu_site_restore.py restore" \
            "$record does it" >&2
        return 4
    fi
}

gpu_env_on_exit() {
    local status=$?
    gpu_env_restore || { [ "$status" -ne 0 ] || status=4; }
    exit "$status"
}

gpu_env_restore_file=$(mktemp "${TMPDIR:-/tmp}/gpu-env-restore.XXXXXX") || exit 4
trap gpu_env_on_exit EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM
# Writes the record only when ensure-series-applied is about to write the tree.
python3 scripts/gpu_site_restore.py save "$site" "$gpu_env_restore_file" || exit 4
scripts/ensure-series-applied "$site" || exit 4
