#!/usr/bin/env bash
# sz/ci.sh BUILD_DIR - build and test sz from scratch (installs nothing).
#  1. CPU build (default compiler, Release, tests on), -j2, ctest
#  2. decoder fuzz run, bounded (SZ_FUZZ_SECONDS, default 60): libFuzzer when clang++ and
#     libclang-rt are present, else a deterministic mutation driver built with the default compiler
#  3. when nvcc exists: CUDA build for one arch (SZ_CI_CUDA_ARCH, default 90), proving it
#     compiles and links; its GPU test binary runs and skips when there is no device
# Exits non-zero on any failure and prints a summary.
set -u -o pipefail
if [ $# -lt 1 ]; then echo "usage: $0 BUILD_DIR" >&2; exit 2; fi
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
JOBS="${SZ_CI_JOBS:-2}"
FUZZ_SECONDS="${SZ_FUZZ_SECONDS:-60}"
CUDA_ARCH="${SZ_CI_CUDA_ARCH:-90}"
START=$(date +%s)
declare -a SUMMARY
FAILED=0

step() {  # step NAME LOG cmd...
  local name="$1" log="$2"; shift 2
  local t0=$(date +%s)
  echo "==> $name"
  if "$@" >"$log" 2>&1; then
    SUMMARY+=("PASS  $name ($(( $(date +%s) - t0 )) s)")
    return 0
  else
    SUMMARY+=("FAIL  $name ($(( $(date +%s) - t0 )) s, log: $log)")
    echo "---- last lines of $log ----"; tail -40 "$log"
    FAILED=1
    return 1
  fi
}

finish() {
  echo
  echo "================ sz CI summary ================"
  for s in "${SUMMARY[@]}"; do echo "  $s"; done
  echo "  total: $(( $(date +%s) - START )) s"
  if [ "$FAILED" = 0 ]; then echo "  RESULT: PASS"; else echo "  RESULT: FAIL"; fi
  exit "$FAILED"
}

# Python with numpy for the binding test: the project venv first
PY=""
for p in "$SRC/../.venv/bin/python" "${SZ_CI_PYTHON:-}" "$(command -v python3 || true)"; do
  if [ -n "$p" ] && [ -x "$p" ] && "$p" -c "import numpy" >/dev/null 2>&1; then PY="$p"; break; fi
done
PYARG=()
if [ -n "$PY" ]; then PYARG=(-DPython3_EXECUTABLE="$PY"); else echo "note: no python with numpy; test_szpy skipped"; fi

# 1. CPU build + unit tests
step "configure (cpu)" "$OUT/cpu-configure.log" \
  cmake -S "$SRC" -B "$OUT/cpu" -DCMAKE_BUILD_TYPE=Release -DSZ_CUDA=OFF -DSZ_BUILD_TESTS=ON "${PYARG[@]}" || finish
step "build (cpu, -j$JOBS)" "$OUT/cpu-build.log" cmake --build "$OUT/cpu" -j "$JOBS" || finish
step "ctest (cpu)" "$OUT/cpu-ctest.log" ctest --test-dir "$OUT/cpu" --output-on-failure --no-tests=error -j "$JOBS"
grep -E "tests passed|Total Test time" "$OUT/cpu-ctest.log" | sed 's/^/    /'
for t in "$OUT"/cpu/tests/test_*; do
  [ -x "$t" ] && printf '    %s: %s gtest cases\n' "$(basename "$t")" "$("$t" --gtest_list_tests | grep -c '^  ')"
done

# 2. fuzz
FUZZ_CC=(); FUZZ_KIND="g++ mutation driver"
if command -v clang++ >/dev/null 2>&1 && command -v clang >/dev/null 2>&1 && \
   echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long){return 0;}' \
   | clang++ -x c++ -fsanitize=fuzzer - -o "$OUT/.fuzzprobe" >/dev/null 2>&1; then
  FUZZ_CC=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++); FUZZ_KIND="libFuzzer"
fi
rm -f "$OUT/.fuzzprobe"
echo "    fuzzer: $FUZZ_KIND, ${FUZZ_SECONDS} s"
step "configure (fuzz, $FUZZ_KIND)" "$OUT/fuzz-configure.log" \
  cmake -S "$SRC" -B "$OUT/fuzz" -DCMAKE_BUILD_TYPE=Release -DSZ_CUDA=OFF -DSZ_BUILD_TESTS=OFF \
  -DSZ_FUZZ=ON -DSZ_FUZZ_SECONDS="$FUZZ_SECONDS" "${FUZZ_CC[@]}" &&
step "build (fuzz)" "$OUT/fuzz-build.log" cmake --build "$OUT/fuzz" -j "$JOBS" &&
step "fuzz decoder (${FUZZ_SECONDS} s)" "$OUT/fuzz-ctest.log" ctest --test-dir "$OUT/fuzz" -V --no-tests=error
grep -E "stat::number_of_executed_units|stat::new_units_added|fuzz_driver:|wrote [0-9]+ seeds" "$OUT/fuzz-ctest.log" | sed 's/^/    /'

# 3. CUDA compile + link
NVCC="$(command -v nvcc || true)"
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -n "$NVCC" ]; then
  step "configure (cuda, sm_$CUDA_ARCH)" "$OUT/cuda-configure.log" \
    cmake -S "$SRC" -B "$OUT/cuda" -DCMAKE_BUILD_TYPE=Release -DSZ_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" -DSZ_BUILD_TESTS=ON &&
  step "build (cuda, -j$JOBS)" "$OUT/cuda-build.log" cmake --build "$OUT/cuda" -j "$JOBS" &&
  step "test_gpu (runs on a device, skips without)" "$OUT/cuda-test.log" "$OUT/cuda/tests/test_gpu"
  grep -E "SKIPPED|PASSED|FAILED" "$OUT/cuda-test.log" | head -3 | sed 's/^/    /'
else
  SUMMARY+=("SKIP  cuda build (no nvcc)")
fi
finish
