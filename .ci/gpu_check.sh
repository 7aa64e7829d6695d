#!/usr/bin/env bash
# The GPU check (issue: CUDA tensors on eccl): on a machine with an NVIDIA GPU, python3
# with torch (a CUDA build) and pytest, and no network, from a checkout holding .gpu/
# (made by .ci/gpu_bundle.sh on a build machine):
#
#   .ci/gpu_check.sh [OUTDIR]        (default: gpu-check/)
#
# Runs, each step under its own time limit, logging everything to OUTDIR/gpu-check.log:
#  1. `eccl-bench probe cuda`: every generated kernel against the CPU, bit for bit, and
#     the GPU's device-to-device and pinned host<->device copy rates;
#  2. `eccl-bench all_reduce --device cuda`: two processes on the GPU over CUDA IPC,
#     checked (-c), 1 MiB to 256 MiB, f32 and bf16, in both abort modes; then with
#     ECCL_CUDA_IPC=0, the staged pipeline through host memory (f32);
#  3. python/tests/test_cuda.py: every collective and dtype x op through the torch
#     backend on CUDA tensors (IPC and staged), DDP against gloo, typed errors;
#  4. examples/ddp_cuda.py: dist.all_reduce and DDP on CUDA, eccl against gloo;
# then, on the machine's CPU cores (the figures a 2-core build machine cannot give):
#  5. shared-memory all_reduce against gloo at 2, 4 and 8 ranks, a one-core memcpy of
#     64 MiB, the torch backend's cost per call at 8 ranks and DDP against gloo at 8
#     ranks (the hot-path issue's targets);
#  6. `eccl-chaos load` to 10,000 simulated peers, the master(s) pinned to cores of
#     their own and the load generator on the rest, one master then three.
# Then OUTDIR/gpu-check.json gathers the figures and each step's verdict, and
# OUTDIR/parts.tgz each step's own JSON. Exit status 0 only when every GPU step passed
# (the CPU steps are measurements: their exit statuses are recorded, not required).
#
# The whole run keeps to GPU_CHECK_BUDGET_S seconds (default 560, so that it ends with
# its JSON inside a 600 s device call): a step gets at most what is left, and a step
# that would start with under 30 s left is skipped and recorded as such. The GPU steps
# go first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu-check.log"
: >"$LOG"
# Each step's JSON and the step list, outside OUTDIR (a device call brings back few
# files): packed into OUTDIR/parts.tgz at the end, and read into gpu-check.json.
PARTS="$(mktemp -d)"
BUDGET="${GPU_CHECK_BUDGET_S:-560}"
PY="${PYTHON:-python3}"
# The wheel and the hash of the sources are in .gpu/; the binaries are packed in
# .gpu/bin.tgz (the device tool carries 64 MiB at most) and unpacked outside the checkout.
BUNDLE="$PWD/.gpu"
BIN="$(mktemp -d)/bin"
export PYTHONUNBUFFERED=1

say() { echo "== $*" | tee -a "$LOG"; }
step() {  # step NAME SECONDS CMD... : runs CMD with a limit, records its status
    # GPU_CHECK_LIMIT_<NAME>=S overrides a step's limit; GPU_CHECK_SKIP="NAME ..." skips steps
    # (a short first look when device time is scarce).
    local name="$1" secs="$2"; shift 2
    case " ${GPU_CHECK_SKIP:-} " in *" $name "*)
        say "$name: skipped (GPU_CHECK_SKIP)"; echo "$name skipped 0" >>"$PARTS/steps.txt"; return;;
    esac
    local over="GPU_CHECK_LIMIT_$name"
    secs="${!over:-$secs}"
    local left=$((BUDGET - SECONDS - 20))
    if [ "$left" -lt 30 ]; then
        say "$name: skipped, ${left}s left of the ${BUDGET}s budget"
        echo "$name no-time 0" >>"$PARTS/steps.txt"
        return
    fi
    [ "$secs" -gt "$left" ] && secs=$left
    say "$name (limit ${secs}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$secs" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - t0))" >>"$PARTS/steps.txt"
    say "$name: exit $rc after $((SECONDS - t0))s"
}
: >"$PARTS/steps.txt"

say "machine"
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
  "$PY" -c 'import torch,sys; print("python", sys.version.split()[0], "torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; \
  nproc; date -u; } >>"$LOG" 2>&1

# A bundle built from other sources than this checkout's would measure old code: said
# before any device time is spent (GPU_CHECK_ALLOW_STALE=1 runs it anyway).
want="$(.ci/gpu_sources.sh)"
have="$(cat "$BUNDLE/SOURCES" 2>/dev/null || echo none)"
if [ "$want" != "$have" ]; then
    say "the bundle in .gpu/ was built from other sources ($have) than this checkout's ($want): run .ci/gpu_bundle.sh after the last change"
    [ "${GPU_CHECK_ALLOW_STALE:-0}" = 1 ] || exit 2
fi
mkdir -p "$BIN"
tar -xzf "$BUNDLE/bin.tgz" -C "$(dirname "$BIN")" >>"$LOG" 2>&1 \
    || { say "cannot unpack $BUNDLE/bin.tgz"; exit 2; }
# The wheel into a private folder (nothing is installed system-wide, nothing fetched).
SITE="$(mktemp -d)/site"
"$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$BUNDLE"/eccl-*.whl >>"$LOG" 2>&1 \
    || { say "cannot install the wheel from $BUNDLE"; exit 2; }
export PYTHONPATH="$SITE:$PWD/python/tests${PYTHONPATH:+:$PYTHONPATH}"
# NVRTC from torch's CUDA wheels, for the Rust binaries (the wheel finds it in-process).
NVRTC="$("$PY" - <<'PY'
import glob, os, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for f in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libnvrtc.so*"))
                    + glob.glob(os.path.join(d, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*"))):
        if "builtins" not in f:
            print(f); sys.exit()
PY
)"
[ -n "$NVRTC" ] && export ECCL_NVRTC_LIB="$NVRTC"
say "NVRTC: ${NVRTC:-none found}"

step probe 120 "$BIN/eccl-bench" probe cuda -b 256M -n 10
for mode in unchanged undefined; do
    step "all_reduce_$mode" 150 "$BIN/eccl-bench" all_reduce --local 2 --device cuda \
        -b 1M -e 256M -f 16 -d float,bfloat16 -c -n 20 -w 5 --on-abort "$mode" \
        --json "$PARTS/all_reduce_$mode.json"
done
# The staged path's pipeline alone (ECCL_CUDA_IPC=0: host memory in about four chunks of
# 4-64 MiB, the copy lanes overlapping the host all_reduce).
step all_reduce_staged 150 env ECCL_CUDA_IPC=0 "$BIN/eccl-bench" all_reduce --local 2 \
    --device cuda -b 1M -e 256M -f 16 -d float -c -n 10 -w 3 --on-abort undefined \
    --json "$PARTS/all_reduce_staged.json"
step pytest 300 "$PY" -m pytest -v -rfE -p no:cacheprovider --timeout "${GPU_CHECK_TEST_TIMEOUT:-100}" python/tests/test_cuda.py
step allreduce_cuda 200 "$PY" examples/ddp_cuda.py --what allreduce --steps 10 \
    --json "$PARTS/allreduce_cuda.json"
step ddp_cuda 240 "$PY" examples/ddp_cuda.py --width 4096 --batch 64 --steps 10 \
    --json "$PARTS/ddp_cuda.json"

# The CPU cores. The examples find the binaries under target/release.
mkdir -p target/release
for b in eccl-bench eccl-chaos; do
    [ -x "$BIN/$b" ] && cp "$BIN/$b" target/release/
done
step cpu_memcpy 30 "$BIN/eccl-bench" probe memcpy -b 64M -n 5
step cpu_gloo 150 "$PY" examples/compare_gloo.py --ranks 2 4 8 -b 1K -e 64M -f 65536 -n 10 -w 2 \
    --json "$PARTS/cpu_gloo.json"
step cpu_overhead 120 "$PY" examples/torch_overhead.py --ranks 2 8 --sizes 1K,64M \
    --iters 1000,10 --rounds 2 --json "$PARTS/cpu_overhead.json"
step cpu_ddp 150 "$PY" examples/compare_ddp.py --nproc 8 --width 4000 --steps 10 --rounds 1 \
    --json "$PARTS/cpu_ddp.json"
# One master on CPU 0, the generator on the others; then three masters on CPUs 0-2.
# Where CPUs cannot be chosen (taskset fails), unpinned, and the log says so.
ncpu="$(nproc)"
if taskset -c 0 true 2>/dev/null && [ "$ncpu" -ge 4 ]; then
    pin1=(taskset -c "1-$((ncpu - 1))") pin3=(taskset -c "3-$((ncpu - 1))")
    own1=(--master-cpus 0) own3=(--master-cpus 0,1,2)
else
    say "load: CPUs cannot be chosen here ($ncpu of them): masters and generator unpinned"
    pin1=() pin3=() own1=() own3=()
fi
step load1 120 "${pin1[@]}" "$BIN/eccl-chaos" load "${own1[@]}" \
    --peers 1000,2000,5000,10000 --steady-s 5 --json "$PARTS/load1.json"
step load3 150 "${pin3[@]}" "$BIN/eccl-chaos" load --masters 3 "${own3[@]}" \
    --peers 1000,2000,5000,10000 --steady-s 5 --json "$PARTS/load3.json"
# Every torch collective and the uneven all_to_all at 8 ranks, if time is left.
step cpu_collectives 90 "$PY" examples/compare_collectives.py --ranks 8 --mib 16 --rounds 1 \
    --iters 5 --json "$PARTS/cpu_collectives.json"
step cpu_alltoall 60 "$PY" examples/compare_alltoall.py --ranks 8 --mib 16 --rounds 1 --iters 5 \
    --patterns rotated hot --json "$PARTS/cpu_alltoall.json"
tar czf "$OUT/parts.tgz" -C "$PARTS" .

"$PY" - "$PARTS" "$LOG" "$OUT" <<'PY'
import json, re, sys
from pathlib import Path
parts, log = Path(sys.argv[1]), Path(sys.argv[2]).read_text(errors="replace")
out = Path(sys.argv[3])
res = {"steps": {}, "probe": {}, "kernels_wrong": {}}
for line in (parts / "steps.txt").read_text().splitlines():
    name, rc, secs = line.split()
    res["steps"][name] = {"exit": int(rc) if rc.lstrip("-").isdigit() else rc,
                          "seconds": int(secs)}
for m in re.finditer(r"^probe (cuda-[\w-]+) bytes (\d+) gbps ([\d.]+) median ([\d.]+)", log, re.M):
    res["probe"][m[1]] = {"bytes": int(m[2]), "best_gbps": float(m[3]), "median_gbps": float(m[4])}
for m in re.finditer(r"^probe cuda-kernel (\w+) (\w+) wrong (\d+)", log, re.M):
    res["kernels_wrong"][f"{m[1]} {m[2]}"] = int(m[3])
for f in ("all_reduce_unchanged", "all_reduce_undefined", "all_reduce_staged", "allreduce_cuda",
          "ddp_cuda", "cpu_gloo", "cpu_overhead", "cpu_ddp", "load1", "load3", "cpu_collectives",
          "cpu_alltoall"):
    p = parts / f"{f}.json"
    if p.exists():
        res[f] = json.loads(p.read_text())
d2d = res["probe"].get("cuda-d2d", {}).get("best_gbps")
h2d = res["probe"].get("cuda-h2d-pinned", {}).get("best_gbps")
targets = {}
for f in ("all_reduce_unchanged", "all_reduce_undefined"):
    for row in res.get(f, {}).get("rows", []):
        if row["bytes"] == 256 << 20 and d2d:
            targets[f"{f} {row['dtype']} 256M busbw / d2d"] = row["busbw_gbps"] / d2d
for row in res.get("all_reduce_staged", {}).get("rows", []):
    if row["bytes"] == 256 << 20 and h2d:
        targets["eccl-bench staged 256M f32 busbw / pinned h2d"] = row["busbw_gbps"] / h2d
ar = res.get("allreduce_cuda", {}).get("runs", {})
if "eccl-staged" in ar and h2d:
    us = ar["eccl-staged"]["256M f32"]
    # bus bandwidth of a 2-rank all_reduce: bytes / time
    targets["staged 256M f32 busbw / pinned h2d"] = (256 << 20) / (us / 1e6) / 1e9 / h2d
ddp = res.get("ddp_cuda", {}).get("runs", {})
if "eccl" in ddp:
    targets["ddp gloo/eccl step"] = ddp["eccl"].get("gloo_over_eccl")
    targets["ddp same params as gloo"] = ddp["eccl"].get("same_params_as_gloo")
if "eccl-staged" in ddp:
    targets["ddp staged gloo/eccl step"] = ddp["eccl-staged"].get("gloo_over_eccl")
    targets["ddp staged same params as gloo"] = ddp["eccl-staged"].get("same_params_as_gloo")
res["targets"] = targets
# The CPU cores' figures (measurements, not part of the verdict).
cpu = {}
m = re.search(r"^probe memcpy bytes (\d+) gbps ([\d.]+)", log, re.M)
if m:
    cpu["memcpy 64M one core GB/s"] = float(m[2])
for n, sets in res.get("cpu_gloo", {}).items():
    rows = {b: {r["bytes"]: r for r in sets.get(b, [])} for b in ("eccl", "gloo")}
    for size, name in ((1024, "1K"), (64 << 20, "64M")):
        e, g = rows["eccl"].get(size), rows["gloo"].get(size)
        if e and g:
            cpu[f"all_reduce {name} {n} ranks eccl us"] = e["time_us"]
            cpu[f"all_reduce {name} {n} ranks gloo/eccl time"] = g["time_us"] / e["time_us"]
    e = rows["eccl"].get(64 << 20)
    if e and n == "2" and "memcpy 64M one core GB/s" in cpu:
        cpu["all_reduce 64M 2 ranks busbw / memcpy"] = e["busbw_gbps"] / cpu["memcpy 64M one core GB/s"]
for row in res.get("cpu_overhead", {}).get("rows", []):
    cpu[f"torch overhead {row['ranks']} ranks {row['bytes']} B us"] = row["overhead_us"]
for b, r in res.get("cpu_ddp", {}).get("over_gloo", {}).items():
    cpu[f"ddp 8 ranks {b}/gloo step (best, worst)"] = r
for f in ("load1", "load3"):
    for step in res.get(f, []):
        cpu[f"{f} {step['peers']} peers"] = {k: step[k] for k in (
            "leader_cpu_pct", "us_per_heartbeat", "commit_ms_p50", "lost", "late_beats",
            "generator_cpu_pct", "kib_per_peer", "evicted", "false_evictions")}
res["cpu"] = cpu
# Two ranks: a sum of two is the same bits in any order, so both of eccl's paths must
# end with gloo's parameters exactly.
gpu_steps = ("probe", "all_reduce_unchanged", "all_reduce_undefined", "all_reduce_staged",
             "pytest", "allreduce_cuda", "ddp_cuda")
# Every GPU step ran and passed (one skipped, or left without time, is not a pass).
res["passed"] = all(res["steps"].get(n, {}).get("exit") == 0 for n in gpu_steps) and \
    not any(res["kernels_wrong"].values()) and \
    all(ddp[n].get("same_params_as_gloo") is True for n in ("eccl", "eccl-staged") if n in ddp)
(out / "gpu-check.json").write_text(json.dumps(res, indent=1))
print(json.dumps({"passed": res["passed"], "steps": res["steps"], "targets": targets, "cpu": cpu},
                 indent=1))
sys.exit(0 if res["passed"] else 1)
PY
