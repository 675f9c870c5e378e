#!/usr/bin/env bash
# The native library under AddressSanitizer + UndefinedBehaviorSanitizer (CI).
#
#   bash tools/sanitize_tests.sh
#
# 1. builds build/asan/libggml_hybrid.so with -DGH_SANITIZE=address,undefined (gcc);
# 2. runs the op, reader, model and API tests against it from Python, with the gcc
#    sanitizer runtimes preloaded (leak detection off: CPython leaks by design);
# 3. builds tools/leakcheck.c against the same library and runs it under
#    LeakSanitizer: model/context/sampler create-free cycles, error paths included.
#
# Any sanitizer report fails the run: the library is built with -fno-sanitize-recover,
# reports abort the process, and every report is also written under build/asan/reports/,
# which must stay empty. By hand, for one test file:
#
#   GH_LIBRARY=build/asan/libggml_hybrid.so \
#   LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
#   ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
#   PYTHONPATH=python python -m pytest -q tests/model/test_model.py
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=build/asan
PY=${PYTHON:-python3}
TESTS=${SANITIZE_TESTS:-"tests/ops/test_op_table.py tests/ops/test_types_matmul.py tests/ops/test_ops_basic.py tests/model/test_gguf_reader.py tests/model/test_load.py tests/model/test_model.py tests/api/test_api.py tests/model/test_bad_models.py tests/sparse/test_sparse_runtime.py tests/sparse/test_sparse_pipeline.py tests/sparse/test_sparse_ffn.py tests/ops/test_device_ops.py tests/gpu/test_cuda_ops.py tests/sparse/test_hybrid.py tests/model/test_threads.py tests/sparse/test_gate_sparsity.py tests/model/test_architectures.py tests/convert/test_pwri.py tests/model/test_embeddings.py::test_hidden_states_equal_transformers tests/model/test_embeddings.py::test_pooling_from_the_file tests/model/test_embeddings.py::test_host_device_equals_cpu tests/model/test_prompt_cache.py::test_restored_state_continues_as_the_continuous_run tests/model/test_prompt_cache.py::test_bad_states_are_refused_and_change_nothing tests/model/test_prompt_cache.py::test_state_calls_claim_the_context tests/model/test_moe_device.py tests/sparse/test_moe_sparse.py"}
REPORTS=$PWD/$BUILD/reports

echo "== sanitize: building $BUILD (ASan + UBSan)"
mkdir -p "$BUILD"
# gcc: the Python run preloads gcc's runtimes. CC (not -DCMAKE_C_COMPILER) so that an
# existing cache is never reset, which would silently drop GH_SANITIZE.
CC=gcc cmake -S . -B "$BUILD" -DGH_SANITIZE=address,undefined -DGH_CUDA=OFF \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$BUILD.configure.log" 2>&1 ||
    { cat "$BUILD.configure.log" >&2; exit 1; }
cmake --build "$BUILD" -j"$(nproc)"
syms=$(nm -D "$BUILD/libggml_hybrid.so")
grep -q __asan_init <<<"$syms" && grep -q __ubsan_handle <<<"$syms" ||
    { echo "sanitize: $BUILD/libggml_hybrid.so is not instrumented (stale cache? rm -rf $BUILD)" >&2; exit 1; }

rm -rf "$REPORTS"
mkdir -p "$REPORTS"
check_reports() {
    if [ -n "$(ls -A "$REPORTS")" ]; then
        echo "== sanitize: FAILED: sanitizer reports ($1):" >&2
        cat "$REPORTS"/* >&2
        exit 1
    fi
}

echo "== sanitize: Python tests against the sanitized library"
LIBASAN=$(gcc -print-file-name=libasan.so)
LIBUBSAN=$(gcc -print-file-name=libubsan.so)
rc=0
# shellcheck disable=SC2086
GH_LIBRARY="$PWD/$BUILD/libggml_hybrid.so" LD_PRELOAD="$LIBASAN $LIBUBSAN" \
ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$REPORTS/asan" \
UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$REPORTS/ubsan" \
PYTHONPATH=python "$PY" -m pytest -q -p no:cacheprovider $TESTS || rc=$?
check_reports "Python tests"
[ "$rc" -eq 0 ] || { echo "== sanitize: FAILED: pytest exited with $rc" >&2; exit "$rc"; }

echo "== sanitize: leak check (LeakSanitizer, standalone C driver)"
gcc -std=gnu11 -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=all \
    -fno-omit-frame-pointer -Iggml-hybrid/include tools/leakcheck.c \
    -L"$BUILD" -lggml_hybrid -Wl,-rpath,"$PWD/$BUILD" -o "$BUILD/leakcheck"
MODEL_DIR=$(mktemp -d)
trap 'rm -rf "$MODEL_DIR"' EXIT
# a tiny random model through the project's sparse converter (GQA, untied head, q8_0
# weights, predictors, and a GPU index solved for a small budget, so that the hybrid
# run below splits neurons)
# (the sparse pipeline profiles through the native library: the sanitized one, as above)
GH_LIBRARY="$PWD/$BUILD/libggml_hybrid.so" LD_PRELOAD="$LIBASAN $LIBUBSAN" \
ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$REPORTS/asan" \
UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$REPORTS/ubsan" \
PYTHONPATH=python:tests "$PY" - "$MODEL_DIR" <<'PYEOF' 2>"$MODEL_DIR/convert.log" ||
import sys
from pathlib import Path

from hf_models import make_llama_model
from powerinfer_cpp.convert import convert
from powerinfer_cpp.sparse.pipeline import SparseOptions

d = Path(sys.argv[1])
hf = make_llama_model(d / "hf", act="relu", tied=False, n_layer=2, d=64, n_head=4, n_head_kv=2,
                   n_ff=128, seed=5)
text = (Path("models/tiny-relu-kjv/heldout.txt")).read_text(encoding="utf-8")[:20000]
(hf / "heldout.txt").write_text(text, encoding="utf-8")
opts = SparseOptions(calib_tokens=512, vram_budget=120000, profile_ctx=128)
convert(hf, d / "model.gguf", outtype="q8_0", progress=False, sparse=True, sparse_options=opts)
PYEOF
    { cat "$MODEL_DIR/convert.log" >&2; echo "sanitize: converting the leak-check model failed" >&2; exit 1; }
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:log_path=$REPORTS/lsan" \
UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$REPORTS/ubsan" \
"$BUILD/leakcheck" "$MODEL_DIR/model.gguf" "${LEAKCHECK_ROUNDS:-5}" || rc=$?
check_reports "leak check"
[ "$rc" -eq 0 ] || { echo "== sanitize: FAILED: leakcheck exited with $rc" >&2; exit "$rc"; }
echo "== sanitize: clean"
