#!/usr/bin/env bash
# Bounded libFuzzer runs of the GGUF reader and of the whole load path (reader, loader,
# a forward pass) (CI; tools/fuzz/README.md has the details).
#
#   bash tools/fuzz_ci.sh            # reader 60 s, then load path 45 s
#   FUZZ_SECONDS=600 LOAD_FUZZ_SECONDS=600 bash tools/fuzz_ci.sh
#
# Builds tools/fuzz/gguf_fuzz.c with clang-14 (-fsanitize=fuzzer,address,undefined) into
# build/fuzz, makes a seed corpus on the fly (every image tests/model/test_gguf_reader.py
# parses, plus tests/data/gguf_regressions/), and fuzzes for FUZZ_SECONDS with the GGUF
# dictionary. A crash, leak, timeout, out-of-memory or sanitizer report exits non-zero
# and copies the input to tests/data/gguf_regressions/ (fix the reader, then keep it:
# test_gguf_reader.py::test_regression_inputs replays that folder).
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_BUDGET=${FUZZ_SECONDS:-60}
CC_FUZZ=${CC_FUZZ:-clang-14}
BUILD=build/fuzz
WORK=$BUILD/run
REGRESSIONS=tests/data/gguf_regressions
PY=${PYTHON:-python3}

command -v "$CC_FUZZ" >/dev/null || { echo "fuzz_ci: $CC_FUZZ not found (apt-get install clang-14 libclang-rt-14-dev)" >&2; exit 1; }

echo "== fuzz_ci: building gguf_fuzz with $CC_FUZZ"
cmake -S . -B "$BUILD" -DCMAKE_C_COMPILER="$CC_FUZZ" -DGH_FUZZ=ON \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$BUILD.configure.log" 2>&1 ||
    { cat "$BUILD.configure.log" >&2; exit 1; }
cmake --build "$BUILD" --target gguf_fuzz load_fuzz -j"$(nproc)"

rm -rf "$WORK"
mkdir -p "$WORK/seed" "$WORK/corpus" "$WORK/artifacts"

echo "== fuzz_ci: seed corpus from tests/model/test_gguf_reader.py"
# The default (non-sanitized) library is enough to make the seeds: the installed package
# if there is one, else the source tree (python/ + build/libggml_hybrid.so or GH_LIBRARY).
PYPATH=""
"$PY" -c "import powerinfer_cpp._native" 2>/dev/null || PYPATH=python
GH_GGUF_DUMP_DIR="$PWD/$WORK/seed" PYTHONPATH="$PYPATH" "$PY" -m pytest -q -p no:cacheprovider \
    tests/model/test_gguf_reader.py >"$WORK/seed.log" 2>&1 ||
    { tail -30 "$WORK/seed.log" >&2; echo "fuzz_ci: making the seed corpus failed" >&2; exit 1; }
if [ -d "$REGRESSIONS" ]; then cp "$REGRESSIONS"/* "$WORK/seed/" 2>/dev/null || true; fi

echo "== fuzz_ci: converter seeds and the key dictionary"
# Small files written by the project's converter (tiny random HF models, both tokenizer
# kinds, several weight types; needs torch + transformers, else skipped), and
# tools/fuzz/gguf.dict extended with every key and tensor name format.py defines (bare
# and as GGUF strings: u64 length + bytes).
PYTHONPATH="$PYPATH${PYPATH:+:}tests" "$PY" - "$WORK" <<'PYEOF' 2>"$WORK/convert.log" ||
import struct, sys, tempfile
from pathlib import Path

from powerinfer_cpp import format as F

work = Path(sys.argv[1])
names = {F.arch_key(v) for k, v in vars(F).items() if k.startswith("KEY_") and isinstance(v, str)}
names |= {F.tensor_name(k) for k in F.GLOBAL_TENSORS}
names |= {F.tensor_name(k, 0) for k in F.LAYER_TENSORS} | {"llama", "gpt2", "relu", "silu"}
esc = lambda b: "".join(f"\\x{c:02x}" for c in b)
lines = Path("tools/fuzz/gguf.dict").read_text().splitlines()
for i, n in enumerate(sorted(names)):
    lines += [f'k{i}="{n}"', f'ks{i}="{esc(struct.pack("<Q", len(n)))}{n}"']
(work / "gguf.dict").write_text("\n".join(lines) + "\n")

try:
    from hf_models import make_llama_model
    from powerinfer_cpp.convert import convert
except Exception as e:  # torch/transformers missing: reader-test seeds only
    print(f"   no converter seeds ({e})")
    sys.exit(0)
tmp = Path(tempfile.mkdtemp(dir=work))
n = 0
for tok in ("bpe", "spm"):
    hf = make_llama_model(tmp / tok, act="relu", n_layer=1, d=32, n_head=2, n_head_kv=1, n_ff=32,
                       vocab=384, tokenizer=tok, tied=tok == "bpe", seed=0)
    for outtype in ("f32", "f16", "q8_0", "q4_0"):
        convert(hf, work / "seed" / f"convert-{tok}-{outtype}.gguf", outtype=outtype, progress=False)
        n += 1
print(f"   {n} converter seeds")
PYEOF
    { tail -20 "$WORK/convert.log" >&2; echo "fuzz_ci: making the converter seeds failed" >&2; exit 1; }
echo "   $(ls "$WORK/seed" | wc -l) seed files, $(grep -c = "$WORK/gguf.dict") dictionary entries"

echo "== fuzz_ci: fuzzing for ${SECONDS_BUDGET}s"
rc=0
"$BUILD/gguf_fuzz" -max_total_time="$SECONDS_BUDGET" -max_len="${FUZZ_MAX_LEN:-4096}" -timeout=10 -rss_limit_mb=2048 \
    -dict="$WORK/gguf.dict" -print_final_stats=1 -artifact_prefix="$WORK/artifacts/" \
    "$WORK/corpus" "$WORK/seed" >"$WORK/fuzz.log" 2>&1 || rc=$?

# Summary: libFuzzer's last status line and its final stats.
grep -E "INITED|DONE|Done [0-9]+ runs" "$WORK/fuzz.log" || true
grep -E "^stat::" "$WORK/fuzz.log" || true

report_findings() {  # $1 = fuzzer's exit code, $2 = its log, $3 = artifacts, $4 = binary
    local found
    found=$(find "$3" -type f | sort)
    if [ "$1" -ne 0 ] || [ -n "$found" ]; then
        echo "== fuzz_ci: FAILED (exit $1); the fuzzer's report:" >&2
        grep -vE "^#[0-9]+" "$2" | tail -80 >&2
        mkdir -p "$REGRESSIONS"
        for f in $found; do
            dst="$REGRESSIONS/fuzz-$(basename "$4")-$(basename "$f" | tr -c 'A-Za-z0-9._\n-' '_').bin"
            cp "$f" "$dst"
            echo "   kept the input as $dst (replay: $BUILD/$(basename "$4") $dst)" >&2
        done
        exit 1
    fi
}
report_findings "$rc" "$WORK/fuzz.log" "$WORK/artifacts" gguf_fuzz
echo "== fuzz_ci: reader clean"

# The load path: tiny complete models (tools/fuzz/load_seeds.py, a few KiB each) and every
# converter seed that loads, whole (-max_len 64 KiB: a model cut to 4 KiB never reaches the
# loader's later checks or the forward pass).
LOAD_SECONDS=${LOAD_FUZZ_SECONDS:-45}
mkdir -p "$WORK/load_seed" "$WORK/load_corpus" "$WORK/load_artifacts"
PYTHONPATH="$PYPATH" "$PY" tools/fuzz/load_seeds.py "$WORK/load_seed" >>"$WORK/convert.log" 2>&1 ||
    { tail -20 "$WORK/convert.log" >&2; echo "fuzz_ci: making the load seeds failed" >&2; exit 1; }
for f in "$WORK"/seed/convert-*.gguf "$REGRESSIONS"/fuzz-load_fuzz-*; do
    [ -f "$f" ] && [ "$(stat -c %s "$f")" -le 65536 ] && cp "$f" "$WORK/load_seed/"
done
echo "== fuzz_ci: fuzzing the load path for ${LOAD_SECONDS}s ($(ls "$WORK/load_seed" | wc -l) seeds)"
rc=0
"$BUILD/load_fuzz" -max_total_time="$LOAD_SECONDS" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
    -dict="$WORK/gguf.dict" -print_final_stats=1 -artifact_prefix="$WORK/load_artifacts/" \
    "$WORK/load_corpus" "$WORK/load_seed" >"$WORK/load_fuzz.log" 2>&1 || rc=$?
grep -E "INITED|DONE|Done [0-9]+ runs" "$WORK/load_fuzz.log" || true
grep -E "^stat::" "$WORK/load_fuzz.log" || true
report_findings "$rc" "$WORK/load_fuzz.log" "$WORK/load_artifacts" load_fuzz
echo "== fuzz_ci: clean"
