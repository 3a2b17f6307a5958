#!/usr/bin/env bash
# Softcap's tanh experiment on one H200 (`bash benchmarks/exp2_device.sh`): GPROJ_TANH=approx
# (tanh.approx.f32) vs the exp2 form; speed on 1×16×8192×128 causal (GPROJ_TRITON_AUTOTUNE=0), fidelity
# with softcap 30, Triton vs reference (features). Logs in $OUT.
set -u
rm -rf /tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 GPROJ_TRITON_AUTOTUNE=0
run() {  # run NAME TANH LIMIT ARGS...
  local name=$1 tanh=$2 lim=$3; shift 3
  echo "== $name tanh=$tanh (t=${SECONDS}s)"
  TRITON_CACHE_DIR=/tmp/tc_$tanh GPROJ_TANH=$tanh timeout "$lim" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? t=${SECONDS}s"; grep -E "TFLOP/s$" "$OUT/$name.log" | sed 's/^/  /'
}
run speed_tanh_approx approx 90 python3 benchmarks/attention.py --methods gproj,none --shapes 3 --softcap 30 --out "$OUT/a"
run fidelity_softcap_tanh_approx approx 110 python3 benchmarks/fidelity.py --out "$OUT/fid" --quick --mus 0,200,1000 --methods gproj,none --softcap 30
grep -E "^\|" "$OUT/fidelity_softcap_tanh_approx.log" | head -16
run gpu_check_tanh_approx approx 150 python3 benchmarks/gpu_check.py --cases features
grep -i "softcap" "$OUT/gpu_check_tanh_approx.log" | head -20
