#!/usr/bin/env bash
# Issue 16 (windows, softcap, varlen, the SDPA registry) on one H200, one device call, nothing to carry:
#   bash benchmarks/issue16_device.sh [all|fidelity|speed|registry|check|dropout]
# fidelity: benchmarks/fidelity.py --quick --mus 0,200,1000, gproj and none (and sdpa_mask, SDPA with the
#           window as a boolean mask) against the float64 reference, once with a causal sliding window
#           (--window 256,0) and once with --softcap 30 (GPROJ_TRITON_AUTOTUNE=0, as in earlier sweeps)
# speed:    benchmarks/attention.py on 1×16×8192×128 causal, gproj and none, plain / --window 1024 /
#           --softcap 30 side by side (autotuned); then --varlen (packed vs padded) if attention.py has it
# registry: benchmarks/registry_check.py (GProj in torch's flash-attention registry)
# dropout:  attention dropout (and softcap after run 12): fidelity with --dropout 0.1 and with --softcap 30,
#           speed with --softcap 30 --dropout 0.1 (GPROJ_TRITON_AUTOTUNE=0, the setting of run 12), the
#           registry check, gpu_check.py --cases dropout
# check:    benchmarks/gpu_check.py (Triton vs kernels/reference.py, GPROJ_TRITON_AUTOTUNE=0), last, with
#           whatever time is left; GPU_CHECK_ARGS (default "--cases features,varlen": the base cases ran
#           in runs 5–10) passes its flags
# Each phase runs under its own `timeout` (at most its cap and never past ISSUE16_BUDGET_S = 540 s from
# the start), so "all" ends inside the device tool's 600 s; every script writes its results as it goes,
# so a phase cut by its limit still returns what it measured. Everything lands in $OUT: one log per
# phase (*.log), fidelity_window/, fidelity_softcap/, attention/ (+ results/speed_issue16.json),
# attention_varlen/. The last lines printed are a summary: each phase's exit status and its key table.
set -u
what=${1:-all}
budget=${ISSUE16_BUDGET_S:-540}
summary=()

rm -rf /tmp/site  # a warm machine keeps the previous call's install; pip --target does not replace it
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p "$OUT/results"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'

# phase NAME CAP LOG COMMAND...: COMMAND under timeout min(CAP, time left − 5 s), output to $OUT/LOG
phase() {
  local name=$1 cap=$2 log=$3 limit rc t0
  shift 3
  limit=$(( budget - SECONDS - 5 ))
  (( cap < limit )) && limit=$cap
  if (( limit < 10 )); then
    echo "$name: not run, ${limit}s left of the ${budget}s budget" | tee "$OUT/$log"
    summary+=("$name: not run (no time left)")
    return
  fi
  echo "== $name (limit ${limit}s, t=${SECONDS}s): $*"
  t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  rc=$?
  summary+=("$name: rc=$rc$( (( rc == 124 )) && echo ' (cut by its time limit)') in $(( SECONDS - t0 ))s, log $log")
  echo "${summary[-1]}"
}

# section FILE HEADING: the markdown section of FILE that starts with HEADING, up to the next "### "
section() {
  [[ -f $1 ]] && awk -v h="$2" 'index($0, h) == 1 {on = 1; print; next} on && /^### / {exit} on' "$1"
}

if [[ $what == all || $what == fidelity ]]; then
  phase fidelity_window 80 fidelity_window.log env GPROJ_TRITON_AUTOTUNE=0 python3 benchmarks/fidelity.py \
    --out "$OUT/fidelity_window" --quick --mus 0,200,1000 --methods gproj,none,sdpa_mask --window 256,0
  phase fidelity_softcap 95 fidelity_softcap.log env GPROJ_TRITON_AUTOTUNE=0 python3 benchmarks/fidelity.py \
    --out "$OUT/fidelity_softcap" --quick --mus 0,200,1000 --methods gproj,none --softcap 30
fi
if [[ $what == all || $what == speed ]]; then
  # --shapes 3: attention.SHAPES[3] = (1, 16, 8192, 128, causal)
  phase speed 130 attention.log python3 benchmarks/attention.py --out "$OUT/attention" \
    --json "$OUT/results/speed_issue16.json" --methods gproj,none --shapes 3 --window 1024 --softcap 30
  if python3 benchmarks/attention.py --help 2>/dev/null | grep -q -- '--varlen'; then
    phase varlen 70 attention_varlen.log python3 benchmarks/attention.py --out "$OUT/attention_varlen" --varlen
  else
    summary+=("varlen: not run (this attention.py has no --varlen)")
  fi
fi
if [[ $what == all || $what == registry ]]; then
  phase registry 70 registry_check.log python3 benchmarks/registry_check.py
fi
if [[ $what == dropout ]]; then
  export GPROJ_TRITON_AUTOTUNE=0
  phase fidelity_dropout 90 fidelity_dropout.log python3 benchmarks/fidelity.py --out "$OUT/fidelity_dropout" \
    --quick --mus 0,200,1000 --methods gproj,none --dropout 0.1
  phase fidelity_softcap 90 fidelity_softcap.log python3 benchmarks/fidelity.py --out "$OUT/fidelity_softcap" \
    --quick --mus 0,200,1000 --methods gproj,none --softcap 30
  phase speed 100 attention.log python3 benchmarks/attention.py --out "$OUT/attention" \
    --json "$OUT/results/speed_issue16.json" --methods gproj,none --shapes 3 --softcap 30 --dropout 0.1
  phase registry 60 registry_check.log python3 benchmarks/registry_check.py
  phase gpu_check 120 gpu_check.log python3 benchmarks/gpu_check.py --cases dropout
fi
if [[ $what == all || $what == check ]]; then
  # shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of flags
  phase gpu_check 600 gpu_check.log env GPROJ_TRITON_AUTOTUNE=0 python3 benchmarks/gpu_check.py ${GPU_CHECK_ARGS:---cases features,varlen}
fi

echo
echo "==================== summary (t=${SECONDS}s) ===================="
printf '%s\n' "${summary[@]}"
for f in window softcap dropout; do
  md="$OUT/fidelity_$f/fidelity.md"
  [[ -f $md ]] || continue
  echo; head -n 1 "$md"
  grep -h '^Skipped' "$md"
  section "$md" "### dq, row-median"
  section "$md" "### dk, per-head Frobenius"
  section "$md" "### C2 residual"
done
if [[ -f $OUT/attention/attention.md ]]; then
  echo; section "$OUT/attention/attention.md" "### fwd+bwd TFLOP/s"
  section "$OUT/attention/attention.md" "### Errors"
  # issue 16's speed bar: a feature's fwd+bwd time over the same method without it
  python3 - "$OUT/results/speed_issue16.json" <<'PY'
import json, sys
rows = {r["method"]: r for r in json.load(open(sys.argv[1])) if r.get("fwdbwd_ms")}
for name, r in rows.items():
    base = rows.get(name.split("+")[0])
    if "+" in name and base:
        print(f"{name}: fwd+bwd {r['fwdbwd_ms']:.2f} ms vs {base['fwdbwd_ms']:.2f} ms, "
              f"{100 * (r['fwdbwd_ms'] / base['fwdbwd_ms'] - 1):+.1f}%")
PY
fi
for log in attention_varlen registry_check gpu_check; do
  [[ -f $OUT/$log.log ]] && { echo; echo "-- tail of $log.log"; tail -n 14 "$OUT/$log.log"; }
done
exit 0
