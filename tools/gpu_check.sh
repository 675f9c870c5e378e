#!/usr/bin/env bash
# gpu_check.sh: the whole CUDA check in one command, for a machine with an NVIDIA GPU.
#
# It builds the library with the CUDA backend (-DGH_CUDA=ON) into a fresh build folder,
# runs nvidia-smi, the CUDA tests (tests/gpu: kernels vs numpy, the hybrid model vs the
# CPU; the op table's host-device and cuda columns, tests/ops/test_op_table.py) and the device
# tests (tests/ops/test_device*.py) with GH_REQUIRE_CUDA=1 (a missing GPU
# fails instead of skipping), then the decode benchmark, and prints a summary: pass /
# fail / skip counts and tokens/s at each budget. Exit status 0 only if the build and
# every test passed. About 2-4 minutes on an H200 machine (16 cores); every step has a
# time limit, the whole stays under ~8 minutes.
#
# Usage
#   tools/gpu_check.sh --prepare      # first, on a machine with internet (this repo's
#                                     # usual one): fills .gpucheck/ (see below)
#   tools/gpu_check.sh                # then on the GPU machine, from the repo root
#   tools/gpu_check.sh --allow-skip   # dry run where there is no GPU: CUDA tests skip
#
# What the GPU machine lacks. It has no internet; its python3 has numpy, pytest, cmake,
# tokenizers, tqdm, pyyaml, requests and sentencepiece, but not cffi or gguf, and the
# sparse converter's ILP solver (mip + cbcbox: a 190 MB wheel) is too big to send. So
# --prepare downloads the cffi, pycparser and gguf wheels for Python 3.12 into
# .gpucheck/wheels/ and converts the shipped model with the sparse pipeline into
# .gpucheck/tiny-sparse-f16.gguf (~20 s) and two tiny MoE models for tests/gpu/test_cuda_moe.py
# (GH_TEST_MOE_DIR; made with transformers), about 13 MB in all, and adds /.gpucheck/ to
# .git/info/exclude. Send that folder along (the device tool: carry [".gpucheck"]); the
# script installs the wheels into a private folder (PYTHONPATH) when an import is missing
# and hands the model to the tests (GH_TEST_SPARSE_GGUF), so nothing is converted there.
# The library is built on the GPU machine from the source tree, and the tests use the
# source tree's Python package (PYTHONPATH=python) with GH_LIBRARY pointing at it.
#
# Environment: PYTHON (default python3), GH_CHECK_BUILD (build folder, default
# /tmp/gh-cuda-build, wiped first), GH_BENCH_TOKENS (decode steps timed, default 128),
# OUT (if set, logs go there: gpu_check.log, cmake.log, build.log, pytest.log, bench.log).

set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
BUILD="${GH_CHECK_BUILD:-/tmp/gh-cuda-build}"
LOGDIR="${OUT:-/tmp/gh-gpu-check-logs}"
mkdir -p "$LOGDIR"
ALLOW_SKIP=0
PREP="$REPO/.gpucheck"

case "${1:-}" in
--prepare)
    mkdir -p "$PREP/wheels"
    grep -qx "/.gpucheck/" .git/info/exclude 2>/dev/null || echo "/.gpucheck/" >>.git/info/exclude
    # wheels for the GPU machine's Python (3.12, x86-64 Linux), versions as installed here
    for pkg in cffi pycparser gguf; do
        ver="$("$PY" -c "import importlib.metadata as m; print(m.version('$pkg'))" 2>/dev/null)"
        spec="$pkg${ver:+==$ver}"
        echo "fetching $spec"
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform any -d "$PREP/wheels" "$spec" || exit 1
    done
    echo "converting models/tiny-relu-kjv (sparse pipeline, f16)"
    "$PY" -m powerinfer_cpp.convert models/tiny-relu-kjv -o "$PREP/tiny-sparse-f16.gguf" \
        --outtype f16 --sparse -q || exit 1
    # tests/gpu/test_cuda_moe.py's models (made with transformers, which the GPU machine lacks)
    echo "making the tiny MoE test models (qwen2moe, mixtral; f32)"
    PYTHONPATH="$REPO/tests:$REPO/python${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$PREP" <<'PYEOF' || exit 1
import sys, tempfile
from hf_models import make_hf_model
from powerinfer_cpp.convert import convert
for v in ("qwen2moe", "mixtral"):  # the variants and seed of tests/gpu/test_cuda_moe.py
    with tempfile.TemporaryDirectory() as d:
        convert(make_hf_model(v, d + "/hf", seed=7), f"{sys.argv[1]}/moe-{v}-f32.gguf", "f32",
                progress=False)
PYEOF
    du -sh "$PREP"
    ls -l "$PREP" "$PREP/wheels"
    exit 0
    ;;
--allow-skip) ALLOW_SKIP=1 ;;
"") ;;
*) sed -n '2,40p' "$0"; exit 2 ;;
esac

exec > >(tee "$LOGDIR/gpu_check.log") 2>&1
T0=$(date +%s)
step() { echo; echo "=== $* ($(( $(date +%s) - T0 )) s)"; }
die() { echo "gpu_check: FAILED: $*"; exit 1; }

# nvcc where CUDA installs it, if the PATH lacks it
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
fi

step "machine"
uname -srm
nproc
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 60 nvidia-smi || echo "(nvidia-smi failed: rc $?)"
else
    echo "nvidia-smi: not found"
fi
command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -2
"$PY" --version

step "python packages"
IMPORTS="import cffi, gguf, numpy, pytest, tokenizers, tqdm"
if ! "$PY" -c "$IMPORTS" 2>/dev/null; then
    if compgen -G "$PREP/wheels/*.whl" >/dev/null; then
        echo "installing $PREP/wheels/*.whl into /tmp/gh-site"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/gh-site "$PREP"/wheels/*.whl || die "pip install of the wheels failed"
        export PYTHONPATH="/tmp/gh-site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "missing Python packages and no $PREP/wheels; trying pip (needs internet)"
        timeout 300 "$PY" -m pip install -q cffi gguf || true
    fi
fi
"$PY" -c "$IMPORTS" || die "Python packages missing: run '$0 --prepare' where pip works (header)"
if [ -f "$PREP/tiny-sparse-f16.gguf" ]; then
    export GH_TEST_SPARSE_GGUF="$PREP/tiny-sparse-f16.gguf"
    echo "model: $GH_TEST_SPARSE_GGUF (prepared)"
elif ! "$PY" -c "import mip" 2>/dev/null; then
    die "no $PREP/tiny-sparse-f16.gguf and no mip to convert one: run '$0 --prepare' first"
fi
# the MoE models tests/gpu/test_cuda_moe.py loads where transformers is missing
[ -f "$PREP/moe-qwen2moe-f32.gguf" ] && export GH_TEST_MOE_DIR="$PREP"

step "build (-DGH_CUDA=ON) in $BUILD"
rm -rf "$BUILD"
B0=$(date +%s)
timeout 120 cmake -S "$REPO" -B "$BUILD" -DGH_CUDA=ON -DCMAKE_BUILD_TYPE=Release >"$LOGDIR/cmake.log" 2>&1 \
    || { tail -40 "$LOGDIR/cmake.log"; die "cmake configure"; }
grep -E "CUDA backend|CUDA compiler" "$LOGDIR/cmake.log"
timeout 600 cmake --build "$BUILD" -j"$(nproc)" >"$LOGDIR/build.log" 2>&1 \
    || { tail -60 "$LOGDIR/build.log"; die "build"; }
BUILD_S=$(( $(date +%s) - B0 ))
grep -iE "warning" "$LOGDIR/build.log" | head -20
echo "built in ${BUILD_S} s: $(ls -l "$BUILD/libggml_hybrid.so" | awk '{print $5}') bytes"

export GH_LIBRARY="$BUILD/libggml_hybrid.so"
export PYTHONPATH="$REPO/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
[ "$ALLOW_SKIP" = 1 ] || export GH_REQUIRE_CUDA=1

step "device check"
"$PY" - <<'EOF' || [ "$ALLOW_SKIP" = 1 ] || die "CUDA is not usable with this build"
from powerinfer_cpp._native import lib, last_error, lib_path
print("library:", lib_path, "| CUDA backend built:", bool(lib.gh_have_cuda()))
st = lib.gh_device_check(b"cuda")
print("gh_device_check('cuda'):", "OK" if st == 0 else f"status {st}: {last_error()}")
raise SystemExit(st)
EOF

step "tests: tests/gpu + tests/ops/test_device*.py + the op table's device columns"
TESTS=(tests/gpu tests/ops/test_device*.py tests/ops/test_op_table.py)
# the op table's CPU columns ran where the code was written; here its host-device and cuda ones
timeout 420 "$PY" -m pytest "${TESTS[@]}" -q -rfEs -p no:cacheprovider \
    -k "not benchmark and (not test_op_table or host-device or cuda)" 2>&1 | tee "$LOGDIR/pytest.log"
TEST_RC=${PIPESTATUS[0]}

step "decode benchmark (GH_BENCH_TOKENS=${GH_BENCH_TOKENS:-128})"
timeout 240 "$PY" -m pytest tests/gpu/test_cuda_model.py -q -s -p no:cacheprovider \
    -k benchmark 2>&1 | tee "$LOGDIR/bench.log"
BENCH_RC=${PIPESTATUS[0]}

step "summary"
count() {
    local n
    n=$(grep -Eo "[0-9]+ $1" "$LOGDIR/pytest.log" | tail -1 | awk '{print $1}')
    echo "${n:-0}"
}
echo "build:     ${BUILD_S} s (CUDA backend, sm_80/86/89/90 + PTX)"
echo "tests:     passed $(count passed) failed $(count failed) errors $(count error)" \
     "skipped $(count skipped) (pytest rc $TEST_RC)"
grep -E "^(FAILED|ERROR) " "$LOGDIR/pytest.log" | head -20
echo "benchmark: (pytest rc $BENCH_RC)"
grep -E "^BENCH " "$LOGDIR/bench.log" || echo "  (no BENCH lines)"
echo "logs:      $LOGDIR; total $(( $(date +%s) - T0 )) s"
if [ "$TEST_RC" -ne 0 ] || [ "$BENCH_RC" -ne 0 ]; then
    echo "gpu_check: FAILED"
    exit 1
fi
echo "gpu_check: OK"
