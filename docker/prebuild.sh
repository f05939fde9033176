#!/usr/bin/env bash
# The image's FlashInfer programs and Humming GEMM kernels, built at `docker build` (no GPU
# there); the Dockerfile runs this after docker/build.sh, and CI runs it with the build command
# replaced (tests/cpu/test_docker_build.py, tests/cpu/test_prebuild_humming.py).
#
#   docker/prebuild.sh
#
# 1. Uninstalls FlashInfer's kernel wheels of another FlashInfer release than the installed
#    one: the base image's `flashinfer download-kernels` installed flashinfer-cubin and
#    flashinfer-jit-cache (with its per-architecture providers) for the FlashInfer it pins
#    (0.7.3 in v0.34.0), and FlashInfer 0.7.4 ignores kernel wheels of another version
#    (flashinfer/jit/env.py), so they only leave warnings and a stale cubin directory.
# 2. Runs `vllm-minimax warmup --prebuild` for PREBUILD_CONFIGS, each with every KV-cache dtype
#    of PREBUILD_KV_CACHE_DTYPES, on every GPU of PREBUILD_GPUS, into FLASHINFER_WORKSPACE_BASE:
#    FlashInfer picks each program as on that GPU, the CUDA compiler builds it, and the server
#    started from the image loads them (docs/warm-start.md). The same command builds Humming's
#    GEMM kernels of the model (no --model: MiniMaxAI/MiniMax-M3-MXFP8, from its known
#    geometry) for each config's TP/EP on each GPU into HUMMING_CACHE_DIR, which the server
#    must read as it is (the image's ENV). PREBUILD_CONFIGS empty skips it.
# 3. Leaves both caches writable by group 0, as the base image does its own caches for the
#    non-root `vllm` user (FlashInfer takes file locks there; Humming writes what a start
#    still builds into its cache).
#
# Environment: PYTHON (default python3), PIP (default "$PYTHON -m pip"), VLLM_MINIMAX (default
# "$PYTHON -m vllm_minimax"), FLASHINFER_WORKSPACE_BASE and HUMMING_CACHE_DIR (required),
# PREBUILD_CONFIGS, PREBUILD_KV_CACHE_DTYPES, PREBUILD_GPUS (defaults below), CUDA_HOME and CXX
# (FlashInfer's).
set -euo pipefail

PYTHON="${PYTHON:-python3}"
PIP="${PIP:-$PYTHON -m pip}"
VLLM_MINIMAX="${VLLM_MINIMAX:-$PYTHON -m vllm_minimax}"
BASE="${FLASHINFER_WORKSPACE_BASE:?prebuild.sh: set FLASHINFER_WORKSPACE_BASE}"
HUMMING="${HUMMING_CACHE_DIR:?prebuild.sh: set HUMMING_CACHE_DIR (where the server reads Humming kernels)}"
# The shipped serving configs for SM90 (the rtx-pro-6000 ones are SM120, where FlashInfer
# 0.7.4 keeps no MSA kernel on disk).
CONFIGS="${PREBUILD_CONFIGS-h100-8x h100-16x-2node h200-8x h200-8x-bf16}"
KV_CACHE_DTYPES="${PREBUILD_KV_CACHE_DTYPES-auto fp8}"
GPUS="${PREBUILD_GPUS-h100 h200}"

# --- 1. kernel wheels of another FlashInfer release ---------------------------------------
stale="$(
    "$PYTHON" - <<'EOF'
import importlib.metadata as md

from vllm_minimax.prebuild import installed_distributions, mismatched_kernel_wheels

print(" ".join(mismatched_kernel_wheels(installed_distributions(), md.version("flashinfer-python"))))
EOF
)"
if [ -n "$stale" ]; then
    echo "prebuild.sh: uninstalling FlashInfer kernel wheels of another release (FlashInfer ignores them): $stale"
    # shellcheck disable=SC2086
    $PIP uninstall -y $stale
else
    echo "prebuild.sh: no FlashInfer kernel wheels of another release"
fi

# --- 2. the programs ----------------------------------------------------------------------
if [ -z "$CONFIGS" ]; then
    echo "prebuild.sh: PREBUILD_CONFIGS is empty: nothing prebuilt"
    exit 0
fi
# FlashInfer links each program with -lcuda (flashinfer/jit/cpp_ext.py). `docker build` mounts
# no driver: where neither the toolkit's stubs nor the system give the linker a libcuda.so, a
# link-time stand-in with the driver's soname (libcuda.so.1) goes on LIBRARY_PATH, which the
# linker searches and the build command FlashInfer compares at start does not name.
CXX_COMPILER="${CXX:-c++}"
cuda_home="${CUDA_HOME:-/usr/local/cuda}"
if ! printf 'int main() { return 0; }\n' | "$CXX_COMPILER" -x c++ - -o /dev/null \
    -L"$cuda_home/lib64" -L"$cuda_home/lib64/stubs" -lcuda 2>/dev/null; then
    stub_dir="$(mktemp -d)"
    printf '\n' | "$CXX_COMPILER" -x c++ - -shared -Wl,-soname,libcuda.so.1 -o "$stub_dir/libcuda.so"
    export LIBRARY_PATH="$stub_dir${LIBRARY_PATH:+:$LIBRARY_PATH}"
    echo "prebuild.sh: no libcuda.so to link against: a stand-in in $stub_dir (LIBRARY_PATH)"
fi
args=(warmup --prebuild --cache-dir "$BASE")
for config in $CONFIGS; do
    args+=(--config "$config")
done
for dtype in $KV_CACHE_DTYPES; do
    args+=(--kv-cache-dtype "$dtype")
done
for gpu in $GPUS; do
    args+=(--gpu "$gpu")
done
echo "prebuild.sh: vllm-minimax ${args[*]}"
# shellcheck disable=SC2086
$VLLM_MINIMAX "${args[@]}"

# --- 3. shared with group 0 ---------------------------------------------------------------
mkdir -p "$BASE" "$HUMMING"
chgrp -R 0 "$BASE" "$HUMMING"
chmod -R g+rwX "$BASE" "$HUMMING"
echo "prebuild.sh: FlashInfer's prebuilt programs are in $BASE, Humming's kernels in $HUMMING"
