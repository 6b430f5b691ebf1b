#!/usr/bin/env bash
# The GPU check (issue 11 item 7): one prepared run, under 10 minutes, on one GPU machine with no internet.
#
#   scripts/gpu_check.sh                 on the GPU machine: CUDA op tests on the GPU, then the V2-Lite-shaped
#                                        Q4_K_M preset benched CPU-only, heterogeneous with --gpu-memory-gib 4,
#                                        all-device (and all-device with decode CUDA graphs), then while time is
#                                        left the matmul kernels alone (pocketmoe.ops.cuda.kernelbench), an op
#                                        profile of all-device decode, and the op tests under compute-sanitizer
#                                        racecheck / memcheck; prints one JSON
#   scripts/gpu_check.sh --cpu-dry-run   the same steps here, --device cpu and the tiny preset (no GPU needed)
#   scripts/gpu_check.sh --fetch-wheels  here, with PyPI: the wheels the GPU machine lacks (gguf) into .whl/,
#                                        which then travels with the tree (name .whl in the run's carry)
#
# Outputs (at most 8 files) go under $OUT when it is set, else out/gpu_check: gpu_check.log, pytest.log,
# bench_{cpu,heterogeneous,all_device,graphs,profile}.json, summary.json (which also holds the TP=1 all-reduce
# cost, the kernel bench and the sanitizer exit codes). Environment: PYTHON (default python3; the dry
# run defaults to .venv/bin/python), GPU_CHECK_WORK (scratch for the 10 GB model, default /tmp/pocketmoe-gpu-check).
#
# No venv is made on the GPU machine: its python3 is itself the venv holding torch (CUDA), CuPy and pybind11, and a
# venv made from it would not see them. What it lacks is installed from .whl/ with pip --no-index --target into
# the scratch directory, which goes on PYTHONPATH with the repo (the native extension is built in place).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
case "${1:-}" in
  --cpu-dry-run) DRY=1 ;;
  --fetch-wheels)
    mkdir -p .whl
    EXCLUDE=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
    mkdir -p "$(dirname "$EXCLUDE")"
    grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
    python3 -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0
    ls -l .whl
    exit 0 ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--cpu-dry-run | --fetch-wheels]" >&2; exit 2 ;;
esac

OUT_DIR=${OUT:-$ROOT/out/gpu_check}
WORK=${GPU_CHECK_WORK:-/tmp/pocketmoe-gpu-check}
mkdir -p "$OUT_DIR" "$WORK"
LOG=$OUT_DIR/gpu_check.log
: > "$LOG"
log() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }
die() { log "FAILED: $*"; exit 1; }
# Every step ends by DEADLINE seconds into the run, so the summary is written inside the device call's 10 minutes
# even when a step hangs: budget N prints the timeout a step gets (at most N seconds, never past the deadline).
DEADLINE=${GPU_CHECK_DEADLINE:-540}
budget() { local left=$((DEADLINE - SECONDS)); if [ "$left" -lt "$1" ]; then echo $((left > 1 ? left : 1)); else echo "$1"; fi; }
export PYTHONUNBUFFERED=1

# ---- 1. environment: what the machine has, plus .whl/ -----------------------------------------------------------
if [ "$DRY" = 1 ]; then
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
  PY=${PYTHON:-python3}
  SITE=$WORK/site
  export PYTHONPATH=$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}
  if ! "$PY" -c 'import gguf' 2>/dev/null; then
    compgen -G ".whl/gguf-*.whl" > /dev/null \
      || die "gguf is not installed and .whl/ holds no gguf wheel; run scripts/gpu_check.sh --fetch-wheels where PyPI is reachable and carry .whl"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl >> "$LOG" 2>&1 \
      || die "pip could not install the wheels of .whl/ (see $LOG)"
  fi
fi
"$PY" -c 'import torch, numpy, gguf' || die "$PY lacks torch, numpy or gguf"
if [ "$DRY" = 0 ]; then
  "$PY" - <<'EOF' || die "no usable CUDA GPU or CuPy here; this script is for a GPU machine (use --cpu-dry-run elsewhere)"
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
import cupy  # noqa: F401
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, CuPy {cupy.__version__}")
EOF
fi
log "python: $("$PY" -c 'import sys, torch; print(sys.executable, torch.__version__)')"
if ! "$PY" -c 'from pocketmoe import native; import sys; sys.exit(0 if native.available() else 1)' 2>/dev/null; then
  log "building the native CPU kernels in place"
  "$PY" setup.py -q build_ext --inplace -j "$(nproc)" >> "$LOG" 2>&1 || "$PY" setup.py -q build_ext --inplace >> "$LOG" 2>&1 \
    || die "the native extension did not build (see $LOG)"
fi

# ---- 2. the model: V2-Lite-shaped Q4_K_M (tiny in the dry run), written in the background while the tests run --
if [ "$DRY" = 1 ]; then PRESET=tiny; else PRESET=full; fi
MODEL=$WORK/deepseek2-$PRESET-Q4_K_M.gguf
SYNTH_PID=""
if [ ! -s "$MODEL" ]; then
  log "writing the deepseek2 $PRESET preset (Q4_K_M) to $MODEL (in the background)"
  "$PY" -m pocketmoe.testing.synth --arch deepseek2 --preset "$PRESET" --quant Q4_K_M --out "$MODEL.part" --quiet \
    > "$WORK/synth.log" 2>&1 &
  SYNTH_PID=$!
fi

# ---- 3. the CUDA op tests (GPU parameters on a GPU; the shim ones here in the dry run) ---------------------------
TESTS=(tests/test_cuda_ops.py tests/test_cuda_backend.py tests/test_cuda_runtime.py)
if [ "$DRY" = 1 ]; then SEL=(-k "not gpu and not every_barrier"); else SEL=(-k "gpu or runtime"); fi
log "pytest ${TESTS[*]} ${SEL[*]}"
set +e
timeout "$(budget 300)" "$PY" -m pytest -q -x -p no:cacheprovider "${SEL[@]}" "${TESTS[@]}" > "$OUT_DIR/pytest.log" 2>&1
TEST_RC=$?
set -e
tail -n 3 "$OUT_DIR/pytest.log" | tee -a "$LOG" >&2
[ "$TEST_RC" = 0 ] || log "the CUDA tests failed (rc $TEST_RC; see pytest.log); the benches still run"
if [ -n "$SYNTH_PID" ]; then
  wait "$SYNTH_PID" || { cat "$WORK/synth.log" >> "$LOG"; die "pocketmoe.testing.synth failed (see gpu_check.log)"; }
  mv "$MODEL.part" "$MODEL"
fi

# ---- 4. benches ---------------------------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
  DEV=cpu; HETERO_GIB=0.008; LEN=(--prompt-tokens 32 --gen-tokens 8)
else
  DEV=cuda; HETERO_GIB=4; LEN=(--prompt-tokens 256 --gen-tokens 32)
fi
BENCH_S=240  # seconds a bench may take (the profile's, later, less)
bench() {  # name, env assignment or "", flags...
  local name=$1 envset=$2; shift 2
  log "bench $name: $*"
  # shellcheck disable=SC2086 # $envset is one NAME=value word or none
  if ! env $envset timeout "$(budget "$BENCH_S")" "$PY" -m pocketmoe.bench --model "$MODEL" "${LEN[@]}" --repeats 1 --json "$@" \
      > "$OUT_DIR/bench_$name.json" 2>> "$LOG"; then
    log "bench $name failed (see gpu_check.log)"
    echo '{"error": "bench failed; see gpu_check.log"}' > "$OUT_DIR/bench_$name.json"
  fi
}
bench cpu "" --device cpu --mode cpu
bench heterogeneous "" --device "$DEV" --mode heterogeneous --gpu-memory-gib "$HETERO_GIB"
bench all_device "" --device "$DEV" --mode all-device
if [ "$DRY" = 0 ]; then bench graphs POCKETMOE_CUDA_GRAPHS=1 --device cuda --mode all-device; fi

# ---- 5. tensor parallelism at TP=1 (issue 12 item 6): the all-reduce per step, NCCL on the GPU (gloo in the dry run) --
# The collective runs even at world size 1 (the model skips it there): the per-call latency floor, projected on paper
# to 2 and 4 GPUs over PCIe at the measured host-to-device bandwidth stand-in (--pcie-gbps; the V2-Lite shapes).
log "TP=1 all-reduce cost: torchrun --nproc-per-node 1 -m pocketmoe.parallel.commbench"
timeout "$(budget 120)" "$PY" -m torch.distributed.run --nproc-per-node 1 -m pocketmoe.parallel.commbench --hidden 2048 \
  --layers 27 --tokens 1,512 --json > "$WORK/tp_comm.json" 2>> "$LOG" || log "the TP=1 all-reduce run failed"

# ---- 6. while time is left: the matmul kernels alone, and where all-device decode's time goes op by op ------------
# kernelbench: each weight type's decode GEMV and a V2-Lite prefill chunk's expert GEMM in GB/s beside the device's
# copy bandwidth (each output checked first); the profile: ms per token by op, each op bracketed by a device sync.
KERNELS=$WORK/kernels.json
echo '{"error": "not run"}' > "$KERNELS"
if [ "$DRY" = 1 ]; then
  KB=(--device cpu --types q4_k,q6_k,q8_0 --gemv 64x512 --experts 4x32x512 --chunk 6 --top-k 2 --attention-keys 300)
else
  KB=(--device cuda)
fi
if [ "$SECONDS" -gt 360 ]; then log "kernel bench and op profile: skipped (${SECONDS} s gone)"; else
  log "kernel bench: python -m pocketmoe.ops.cuda.kernelbench ${KB[*]}"
  set +e
  timeout "$(budget 90)" "$PY" -m pocketmoe.ops.cuda.kernelbench "${KB[@]}" --json > "$KERNELS.part" 2>> "$LOG"
  rc=$?
  set -e
  if [ -s "$KERNELS.part" ]; then mv "$KERNELS.part" "$KERNELS"; fi  # exit 1 (a wrong kernel) still reports
  [ "$rc" = 0 ] || log "kernel bench: exit $rc (1: a kernel's output was wrong, the report says which; 124: out of time)"
  LEN=(--prompt-tokens 64 --gen-tokens 8)
  BENCH_S=90
  bench profile "" --device "$DEV" --mode all-device --profile
fi

# ---- 7. compute-sanitizer on the GPU op tests, while time is left: what the CPU shim can only approximate ----------
# racecheck: shared-memory hazards between the threads of a block; memcheck: out-of-bounds and misaligned accesses
# (torch's caching allocator off, so a read past a tensor is past its allocation). Each at most 100 s; skipped once
# 7 minutes of the run are gone. Exit code 86 is a sanitizer report; the reports go to gpu_check.log.
SAN=$WORK/sanitizer.json
SAN_RC=""  # '"racecheck": 0, "memcheck": 86': the exit codes, for summary.json
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1 || true)
if [ "$DRY" = 0 ] && [ -n "$SANITIZER" ]; then
  for tool in racecheck memcheck; do
    if [ "$SECONDS" -gt 420 ]; then log "compute-sanitizer $tool: skipped (${SECONDS} s gone)"; continue; fi
    log "compute-sanitizer --tool $tool on the GPU op tests"
    set +e
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(budget 100)" "$SANITIZER" --tool "$tool" --error-exitcode 86 --print-limit 20 \
      "$PY" -m pytest -q -x -p no:cacheprovider -k gpu tests/test_cuda_ops.py tests/test_cuda_backend.py \
      > "$WORK/sanitizer_$tool.log" 2>&1
    rc=$?
    set -e
    tail -n 40 "$WORK/sanitizer_$tool.log" >> "$LOG"
    SAN_RC+="${SAN_RC:+, }\"$tool\": $rc"
    log "compute-sanitizer $tool: exit $rc (0 clean, 86 a report, 124 out of time, else the tests failed)"
  done
else
  log "compute-sanitizer: not run (dry run, or not installed)"
fi
echo "{$SAN_RC}" > "$SAN"

# ---- 8. bandwidth bounds and the summary ---------------------------------------------------------------------------
"$PY" - "$OUT_DIR" "$DRY" "$WORK" <<'EOF' | tee "$OUT_DIR/summary.json"
import json, sys
from pathlib import Path

import torch

from pocketmoe.ops.cuda.kernelbench import Timer, copy_gbps

out, dry, work = Path(sys.argv[1]), sys.argv[2] == "1", Path(sys.argv[3])

# the bounds the kernel bench measures against (its copy_gbps: bytes read + written), host-to-device beside it
n = 1 << 28  # 256 MiB
if torch.cuda.is_available() and not dry:
    cuda = torch.device("cuda")
    timer = Timer(cuda)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=cuda)
    pcie = n / timer.per_call(lambda i: dev.copy_(host, non_blocking=True)) / 1e9
    hbm = copy_gbps(cuda, timer, n)
    device = torch.cuda.get_device_name()
else:  # the dry run: host memory stands in for both
    pcie = hbm = copy_gbps(torch.device("cpu"), Timer(torch.device("cpu")), n)
    device = "cpu (dry run)"


def load_json(p):
    try:
        return json.loads(p.read_text())
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{p.name}: {exc}"}


def load(name):
    return load_json(out / f"bench_{name}.json")


def figures(js, bound_gbps=None):
    if "pocketmoe" not in js:
        return {"error": js.get("error", "no result")}
    e = js["pocketmoe"]
    ex = e.get("experts") or {}
    st, pst = ex.get("stats") or {}, ex.get("prefill_stats") or {}
    bpt = (js.get("bound") or {}).get("bytes_per_token")
    r = {"prefill_tok_s": e["prefill_tok_s"], "decode_tok_s": e["decode_tok_s"], "detail": e.get("detail"),
         "mode": ex.get("mode", "cpu"), "cache_slots": ex.get("cache_slots"), "hit_rate": st.get("hit_rate"),
         "bytes_copied_per_token": st.get("bytes_copied_per_token"),
         "prefill_bytes_copied_per_token": pst.get("bytes_copied_per_token"),
         "cpu_experts_per_token": st.get("cpu_experts_per_token"),
         "plan_decode_tok_s": ex.get("plan_decode_tok_s"), "cost_model_decode_tok_s": ex.get("cost_model_decode_tok_s"),
         "peak_device_memory_gib": e.get("peak_device_memory_gib"), "bytes_per_token": bpt}
    copied = st.get("bytes_copied_per_token") or 0
    r["pcie_bound_decode_tok_s"] = pcie * 1e9 / copied if copied else None  # copies alone, nothing else
    if bpt:
        r["hbm_bound_decode_tok_s"] = hbm * 1e9 / bpt
        r["fraction_of_hbm_bound"] = e["decode_tok_s"] / r["hbm_bound_decode_tok_s"]
    return r


cpu, het, alld, gr = (figures(load(n)) for n in ("cpu", "heterogeneous", "all_device", "graphs"))


# ("eager" or "graphs", its fraction of the HBM bound): the faster all-device decode, None without either figure
best = max(((n, f["fraction_of_hbm_bound"]) for n, f in (("eager", alld), ("graphs", gr))
            if "fraction_of_hbm_bound" in f), key=lambda r: r[1], default=None)


def ok(f):
    try:
        return bool(f())
    except Exception:  # noqa: BLE001 - a missing figure
        return None


summary = {
    "device": device, "dry_run": dry, "pcie_gbps": round(pcie, 2), "hbm_gbps": round(hbm, 2),
    "cpu_only": cpu, "heterogeneous_4gib": het, "all_device": alld, "all_device_graphs": gr,
    "tp1_all_reduce": load_json(work / "tp_comm.json"),
    "all_device_decode_ms_per_token_by_op": ((load("profile").get("pocketmoe") or {}).get("profile") or {}).get("decode"),
    "kernels": load_json(work / "kernels.json"),
    "compute_sanitizer_exit": load_json(work / "sanitizer.json"),
    "targets": {
        "heterogeneous_decode_ge_cpu": ok(lambda: het["decode_tok_s"] >= cpu["decode_tok_s"]),
        "heterogeneous_prefill_ge_3x_cpu": ok(lambda: het["prefill_tok_s"] >= 3 * cpu["prefill_tok_s"]),
        "heterogeneous_peak_le_3_6_gib": ok(lambda: het["peak_device_memory_gib"] <= 3.6),
        # all-device mode as a user runs it at its best: eager, or with decode CUDA graphs (POCKETMOE_CUDA_GRAPHS=1)
        "all_device_decode_ge_half_hbm_bound": ok(lambda: best[1] >= 0.5),
    },
    "all_device_best": None if best is None else {"run": best[0], "fraction_of_hbm_bound": best[1]},
}
print(json.dumps(summary, indent=1))
EOF
log "done; outputs in $OUT_DIR"
exit "$TEST_RC"
