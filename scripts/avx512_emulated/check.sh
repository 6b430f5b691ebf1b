#!/usr/bin/env bash
# Runs the C++ kernel tests on an emulated AVX-512 VNNI CPU (Bochs 2.7, CPU model tigerlake), for
# machines without one: the dispatcher then picks the AVX-512 VNNI kernels, checks them against
# AVX2 at start-up, and every test of test_kernels runs on them.
#
#   scripts/avx512_emulated/check.sh        (make avx512-emulated)
#
# Three static programs run in the guest, a few minutes each (Bochs runs ~50 M instructions/s):
#   1. evex_disp8_check: single EVEX instructions with 8-bit displacements against the values they
#      must load. Under Bochs 2.7, VPINSRB is WRONG (it scales the displacement by 2, where the
#      Intel SDM's disp8*N has N = 1); the others are right. Reported, not a failure of ours.
#   2. test_kernels as built for users. Its IQ1_M AVX-512 kernel contains EVEX VPINSRB with an 8-bit
#      displacement (GCC spills to the stack and reloads into xmm16-31), so under Bochs 2.7 it
#      differs from AVX2, the start-up check refuses the set and AVX2 runs: expected here, and a
#      demonstration of the fallback. Every other type must match.
#   3. test_kernels with the AVX-512 code kept out of xmm16-31 (-ffixed-xmm16..31; the assembler
#      then picks the VEX form of VPINSRB): the AVX-512 VNNI kernels must pass the start-up check
#      and every test.
# Needs (Debian): bochs bochsbios vgabios xorriso cpio libsimde-dev, and apt-get download for the
# guest kernel (first run only). Exit status 0 when 3 passes and 2 fails only on IQ1_M, if at all.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$ROOT/out/avx512_emulated}"
mkdir -p "$OUT"

echo "== building (static)"
g++ -O1 -mavx512f -mavx512bw -mavx512vl -mf16c -static "$HERE/evex_disp8_check.cpp" -o "$OUT/evex_disp8_check"
cmake -S "$ROOT/cpp_engine" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXE_LINKER_FLAGS=-static >/dev/null
cmake --build "$OUT/build" -j2 --target test_kernels >/dev/null
fixed=""
for i in $(seq 16 31); do fixed+=" -ffixed-xmm$i"; done
cmake -S "$ROOT/cpp_engine" -B "$OUT/build_low_regs" -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXE_LINKER_FLAGS=-static \
  -DCMAKE_CXX_FLAGS="$fixed" >/dev/null
cmake --build "$OUT/build_low_regs" -j2 --target test_kernels >/dev/null

echo "== 1. EVEX loads with disp8 under Bochs"
"$HERE/run_in_bochs.sh" "$OUT/evex_disp8_check" | tee "$OUT/evex_disp8_check.txt" || true

echo "== 2. test_kernels as built for users"
"$HERE/run_in_bochs.sh" "$OUT/build/test_kernels" | tee "$OUT/test_kernels.txt" || true

echo "== 3. test_kernels, AVX-512 code out of xmm16-31"
status=0
"$HERE/run_in_bochs.sh" "$OUT/build_low_regs/test_kernels" | tee "$OUT/test_kernels_low_regs.txt" || status=$?

echo "== summary"
if [ "$status" -eq 0 ] && head -1 "$OUT/test_kernels_low_regs.txt" | grep -q "^avx512vnni int8 kernels"; then
  echo "3: AVX-512 VNNI kernels chosen, start-up check passed, all tests passed"
else
  echo "3: FAILED (status $status)"; exit 1
fi
# In 2, only IQ1_M may differ (the Bochs VPINSRB bug); any other type is a failure.
others=$(grep -o "avx512vnni, [0-9]* rows: .*" "$OUT/test_kernels.txt" | tr ';' '\n' | grep -v "IQ1_M" | grep -c "gives" || true)
if [ "$others" -ne 0 ]; then
  echo "2: AVX-512 kernels other than IQ1_M differ from AVX2"; exit 1
fi
echo "2: every type but IQ1_M bitwise equal to AVX2 ($(head -1 "$OUT/test_kernels.txt"))"
