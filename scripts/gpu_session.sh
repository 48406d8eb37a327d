#!/usr/bin/env bash
# Every GPU check in one call, for a GPU machine that is lent for minutes and cannot reach a package index.
#
# What `make gpu-checks` runs, plus what a lent machine needs around it: the missing pure-Python and wheel
# dependencies installed from ./.whl (no network there), each step under its own time limit so that one
# hung step leaves the others' results, and the dense run analyzed and predicted like any user's run.
# Every result lands in $OUT (at most 8 files):
#
#   gpu_check.json       scripts/gpu_check.py: the trainer's MFU on one GPU from CUDA-event step times,
#                        the collectors' GPU paths, the cost model's memory against max_memory_allocated
#   dense_report.json    `mfuscope analyze` of that run: the breakdown and first finding on a real CUDA trace
#   predict.json         `mfuscope predict` of that run with the published profile (never fitted on it)
#   kernels_check.json   scripts/gpu_kernels_check.py: every fused kernel in bf16 and float32 on CUDA
#   fused_report.json    the same dense run with --kernels fused, analyzed (the fix, re-measured)
#   fused_run.tar.gz     its run directory, as dense_run.tar.gz
#   bench_kernels.json   benchmarks/bench_kernels.py: each kernel against eager, torch.compile, Liger
#   dense_run.tar.gz     the dense run directory (its Kineto trace of a real CUDA job, when under 15 MiB)
#   (lm_head_profile.log, in logs.tar.gz: the fused LM head's kernels, one forward and backward)
#   logs.tar.gz          every step's log, and env.txt: GPU, driver, python, torch, triton, NCCL
#
#   OUT=artifacts/gpu bash scripts/gpu_session.sh          # on the GPU machine (python3 = its CUDA torch)
#   DEVICE=cpu OUT=/tmp/g bash scripts/gpu_session.sh      # a dry run of the whole sequence on a CPU
#   BENCH_OPS=linear_ce ...                                # bench_kernels on these ops only
#   STEPS=kernels_check,bench_kernels ...                  # these steps only (default: all)
#
# Exit status: 0 when every step passed, else the number of failed steps (setup failure: 100).
set -u
OUT=${OUT:-artifacts/gpu}
PY=${GPU_PY:-python3}
DEVICE=${DEVICE:-cuda}
WORK=${WORK:-/tmp/mfuscope_gpu}
mkdir -p "$OUT" "$WORK/logs"
rm -rf "${WORK:?}/runs"
export PYTHONUNBUFFERED=1
failed=0

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log to $WORK/logs/NAME.log
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  case ",${STEPS:-all}," in *",all,"*|*",$name,"*) ;; *) echo "gpu_session: $name: skipped (STEPS=$STEPS)"; return 0;; esac
  timeout -k 15 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1
  rc=$?
  echo "gpu_session: $name: exit $rc in $((SECONDS - t0)) s (limit $limit s)"
  if [ $rc -ne 0 ]; then failed=$((failed + 1)); tail -n 25 "$WORK/logs/$name.log" | sed 's/^/    /'; fi
  # after every step: what is under $OUT comes back even if the call is stopped at its limit
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs runs/dense/manifest.json runs/fused/manifest.json 2>/dev/null
  return 0
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if
torch.cuda.is_available() else None)" 2>&1
} > "$WORK/logs/env.txt"
cat "$WORK/logs/env.txt"

# Setup: the wheels carried in .whl, then mfuscope itself (editable, offline: no build isolation).
if ! "$PY" -c "import msgspec, isal, jsonschema" > /dev/null 2>&1 && ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl > "$WORK/logs/setup.log" 2>&1 \
    || { cat "$WORK/logs/setup.log"; exit 100; }
fi
if ! "$PY" -c "import mfuscope.analyzers" > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$WORK/logs/setup.log" 2>&1 \
    || { cat "$WORK/logs/setup.log"; exit 100; }
fi
"$PY" -c "import mfuscope.analyzers, mfuscope.kernels" || exit 100

if [ "$DEVICE" = cpu ]; then
  export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
  CHECK=(--device cpu --config tiny_dense --steps 6 --warmup 1)
  KCHECK=(--device cpu --small)
  TRAIN=(--config tiny_dense --steps 6 --window 3:2 --nproc 1)
  BENCH=(--rounds 1)
else
  CHECK=(--timeout 240 --path-timeout 60)
  KCHECK=()
  TRAIN=(--config gpu_dense_1b --steps 14 --window 11:2 --nproc 1)
  BENCH=(--rounds 5 --models 8b,70b)
fi

keep_run() {  # keep_run NAME: $WORK/runs/NAME analyzed, its report and (under 15 MB) the directory in $OUT
  local name=$1
  step "analyze_$name" 90 "$PY" -m mfuscope analyze "$WORK/runs/$name" --force
  cp "$WORK/runs/$name/report.json" "$OUT/${name}_report.json" 2>/dev/null
  tar -czf "$OUT/${name}_run.tar.gz" -C "$WORK/runs" "$name"
  [ "$(stat -c %s "$OUT/${name}_run.tar.gz")" -lt 15000000 ] \
    || tar -czf "$OUT/${name}_run.tar.gz" -C "$WORK/runs" --exclude=traces --exclude=views "$name"
}

step gpu_check 300 "$PY" scripts/gpu_check.py "${CHECK[@]}" --run-dir "$WORK/runs" --json "$OUT/gpu_check.json"
DENSE=$WORK/runs/dense
if [ -f "$DENSE/manifest.json" ]; then
  keep_run dense
  step predict_dense 45 bash -c '"$0" -m mfuscope predict "$1" --json > "$2"' "$PY" "$DENSE" "$OUT/predict.json"
fi
step kernels_check 150 "$PY" scripts/gpu_kernels_check.py "${KCHECK[@]}" --json "$OUT/kernels_check.json"
step bench_kernels 150 "$PY" benchmarks/bench_kernels.py "${BENCH[@]}" --ops "${BENCH_OPS:-rms_norm,add_rms_norm,swiglu,rope,linear_ce,moe_permute}" --json "$OUT/bench_kernels.json"
# Where the fused LM head's time goes, kernel by kernel.
step lm_head_profile 120 "$PY" - "$DEVICE" <<'PYEOF'
import sys, torch
from torch.profiler import ProfilerActivity, profile
from mfuscope.kernels import fused_linear_cross_entropy
cuda = sys.argv[1] == "cuda"
dev, dt, (n, h, v) = ("cuda", torch.bfloat16, (8192, 4096, 128256)) if cuda else ("cpu", torch.float32, (64, 64, 1000))
g = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(n, h, generator=g, device=dev).to(dt).requires_grad_()
w = (0.02 * torch.randn(v, h, generator=g, device=dev)).to(dt).requires_grad_()
t = torch.randint(0, v, (n,), generator=g, device=dev)
for _ in range(2):
    fused_linear_cross_entropy(x, w, t).backward()
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
with profile(activities=acts) as prof:
    fused_linear_cross_entropy(x, w, t).backward()
    if cuda:
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=12))
PYEOF
step train_fused 180 "$PY" -m mfuscope train "${TRAIN[@]}" --kernels fused --out "$WORK/runs/fused" --force
[ -f "$WORK/runs/fused/manifest.json" ] && keep_run fused

echo "gpu_session: $failed step(s) failed; results in $OUT"
exit $failed
