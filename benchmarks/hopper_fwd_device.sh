#!/usr/bin/env bash
# The sm_90 Gluon forward (kernels/attention_fwd_hopper.py) on one H200, one device call, nothing to carry:
#   bash benchmarks/hopper_fwd_device.sh
# 1. gpu_check.py --cases hopper,base: the Gluon forward against reference.py and the tl.dot forward, the
#    backward fed its statistics, the constants; the 8 base cases (every fix) as before;
# 2. forward A/B on the 8 shapes of attention.py, fix none, AUTOTUNE=0: GPROJ_HOPPER_FWD=0 (tl.dot) against
#    the default (Gluon where served), cuDNN in the second run;
# 3. train_step.py, both Llama configurations, arms cudnn / gproj / none (nothing else on the GPU meanwhile).
# Each phase has its own limit (150 + 2×100 + 200 s).
set -u
rm -rf /tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p "$OUT/results"
GPROJ_TRITON_AUTOTUNE=0 timeout 150 python3 benchmarks/gpu_check.py --cases hopper,base > "$OUT/gpu_check_hopper.log" 2>&1
echo "check rc=$?"; grep -E "hopper|worst|^\(" "$OUT/gpu_check_hopper.log"
for f in 0 1; do
  methods=none; [[ $f == 1 ]] && methods=none,cudnn
  GPROJ_HOPPER_FWD=$f GPROJ_TRITON_AUTOTUNE=0 timeout 100 python3 benchmarks/attention.py --out "$OUT/fwd_hopper$f" \
    --methods "$methods" > "/tmp/fwd_hopper$f.log" 2>&1
  echo "fwd A/B GPROJ_HOPPER_FWD=$f rc=$?"; rm -f "$OUT/fwd_hopper$f"/*.png "$OUT/fwd_hopper$f"/*.json
  grep -A12 "### fwd TFLOP" "$OUT/fwd_hopper$f/attention.md"
done
timeout 200 python3 benchmarks/train_step.py --out "$OUT/results/train_step_latest.json" --arms cudnn,gproj,none \
  --warmup 5 --steps 15 > "$OUT/train_step.log" 2>&1
echo "train rc=$?"; tail -n 8 "$OUT/train_step.log"
