#!/usr/bin/env bash
# Build steps of the patched vLLM image; the Dockerfile runs this, and so does CI
# (tests/cpu/test_docker_build.py, against a scratch vLLM tree, with --skip-pip).
#
#   docker/build.sh [--skip-pip] [--target DIR]
#
# 1. Checks that the vLLM it patches has a series in patches/ (and, when
#    EXPECTED_VLLM_VERSION is set, e.g. from the image tag, that it is that version).
# 2. Uninstalls cuda-python and cuda-bindings, then installs requirements/user-flashinfer.txt
#    (--no-deps): flashinfer-python 0.7.4 over the image's pin (0.7.3 in v0.34.0,
#    0.7.2.post1 in v0.33.0) and the cuda-python / cuda-bindings pair its msa_ops imports
#    with; then only those of 0.7.4's requirements the environment does not already
#    satisfy, with vLLM's own pins held (torch, apache-tvm-ffi, nvidia-cutlass-dsl, ...).
# 3. Installs this package (pip install --no-deps .), and fails unless flashinfer.msa_ops
#    imports.
# 4. Runs `vllm-minimax apply`, then `vllm-minimax status`, and fails unless the
#    status says the series is applied and every file is as applied.
# --skip-pip skips steps 2 and 3 (CI: the environment is already built).
#
# Environment: PYTHON (default python3), PIP (default "$PYTHON -m pip"),
# TARGET (a directory holding vllm/; default: the vLLM installed for PYTHON),
# EXPECTED_VLLM_VERSION (optional).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
PIP="${PIP:-$PYTHON -m pip}"
TARGET="${TARGET:-}"
RECIPE="$REPO/requirements/user-flashinfer.txt"
FLASHINFER_VERSION="$(sed -n 's/^flashinfer-python==//p' "$RECIPE")"
EXPECTED_VLLM_VERSION="${EXPECTED_VLLM_VERSION:-}"
SKIP_PIP=0

die() {
    echo "build.sh: error: $*" >&2
    exit 1
}

while [ $# -gt 0 ]; do
    case "$1" in
        --skip-pip) SKIP_PIP=1 ;;
        --target)
            [ $# -ge 2 ] || die "--target needs a directory"
            TARGET="$2"
            shift
            ;;
        -h | --help)
            sed -n '2,22p' "$0"
            exit 0
            ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
    shift
done

target_args=()
if [ -n "$TARGET" ]; then
    target_args=(--target "$TARGET")
fi

# --- 1. a series for this vLLM ------------------------------------------------------------
# Read from the repository's sources (nothing installed yet); vLLM is never imported.
echo "build.sh: checking the vLLM version against patches/"
if ! version_check="$(
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" TARGET="$TARGET" \
        EXPECTED_VLLM_VERSION="$EXPECTED_VLLM_VERSION" "$PYTHON" - <<'EOF' 2>&1
import os
import sys
from pathlib import Path

from vllm_minimax import patchset

try:
    root = patchset.find_vllm_root(Path(os.environ["TARGET"]) if os.environ["TARGET"] else None)
    version = patchset.read_vllm_version(root)
    expected = os.environ["EXPECTED_VLLM_VERSION"]
    if expected and expected != version:
        raise patchset.PatchError(
            f"vLLM in {root} is {version}, but this build expects {expected}"
            " (the base image tag); build FROM the image of the vLLM version you patch"
        )
    series = patchset.require_series_dir(version)
except patchset.PatchError as error:
    print(error)
    sys.exit(1)
print(f"vLLM {version} at {root}: series {series.name}")
EOF
)"; then
    die "$version_check"
fi
echo "build.sh: $version_check"

# --- 2 and 3. FlashInfer 0.7.4 and this package -----------------------------------------
if [ "$SKIP_PIP" -eq 0 ]; then
    echo "build.sh: installing $RECIPE (--no-deps), the CUDA-bindings pair removed first"
    # vLLM 0.34.0 pins flashinfer-python==0.7.3 and 0.33.0 pins 0.7.2.post1 (no SM90
    # msa_ops); both series target 0.7.4's msa_ops. cuda-python 12.x and cuda-bindings 13.x
    # both write cuda/bindings/: replacing them in one pip run can delete the new files
    # (README, "Install"), so both go first, as README's recipe does.
    $PIP uninstall -y cuda-python cuda-bindings
    $PIP install --no-cache-dir --no-deps -r "$RECIPE"

    # 0.7.4's requirements that are not met here, and pins that keep vLLM's stack as is.
    missing_and_constraints="$(
        "$PYTHON" - <<'EOF'
import importlib.metadata as md
import re

from packaging.requirements import Requirement

def installed(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

missing = []
for line in md.requires("flashinfer-python") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    have = installed(req.name)
    if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
        missing.append(str(req))
held = ["vllm", "torch", "torchvision", "torchaudio", "triton", "flashinfer-python"]
for line in md.requires("vllm") or []:
    req = Requirement(line)
    if any(spec.operator == "==" for spec in req.specifier):
        held.append(req.name)
pins = []
for name in dict.fromkeys(held):
    version = installed(name)
    if version is not None and not any(
        re.sub(r"[-_.]+", "-", Requirement(m).name).lower() == re.sub(r"[-_.]+", "-", name).lower()
        for m in missing
    ):
        pins.append(f"{name}=={version}")
print(" ".join(missing))
print("\n".join(pins))
EOF
    )"
    read -r -a missing <<<"$(head -n 1 <<<"$missing_and_constraints")"
    if [ "${#missing[@]}" -gt 0 ]; then
        constraints="$(mktemp)"
        tail -n +2 <<<"$missing_and_constraints" >"$constraints"
        echo "build.sh: installing flashinfer-python $FLASHINFER_VERSION's unmet requirements: ${missing[*]}"
        $PIP install --no-cache-dir -c "$constraints" "${missing[@]}"
        rm -f "$constraints"
    else
        echo "build.sh: flashinfer-python $FLASHINFER_VERSION's requirements are already met"
    fi

    echo "build.sh: installing vllm-minimax (--no-deps)"
    $PIP install --no-cache-dir --no-deps "$REPO"

    # pip exits 0 from installs that leave msa_ops unimportable (issue 57): check it here.
    if ! msa_ops_error="$("$PYTHON" -c 'import flashinfer.msa_ops' 2>&1)"; then
        die "flashinfer.msa_ops does not import after the installs above: $(tail -n 1 <<<"$msa_ops_error")"
    fi
    echo "build.sh: flashinfer.msa_ops imports"
fi

# --- 4. apply, then insist on a clean status ----------------------------------------------
"$PYTHON" -m vllm_minimax apply "${target_args[@]}"
status="$("$PYTHON" -m vllm_minimax status "${target_args[@]}")"
echo "$status"
if ! grep -Eq '^state: +applied \(' <<<"$status" || grep -q '^problem:' <<<"$status"; then
    die "vllm-minimax status is not clean after apply (see above)"
fi
if grep -E '^  ' <<<"$status" | grep -Evq '^  as-applied  '; then
    die "vllm-minimax status lists files that are not as applied (see above)"
fi
echo "build.sh: the series is applied and status is clean"
