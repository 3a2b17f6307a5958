#!/usr/bin/env bash
# Issue 12 on one H200 (benchmarks/NOTES.md, "Run 10 plan"), one device call, nothing to carry:
#   bash benchmarks/speed_device.sh [all|check|attention|kernels|train]
# check:     the backward against reference.py on the GPU (gpu_check.py)
# attention: benchmarks/attention.py --json, every shape with and without the causal mask, gproj and none,
#            cuDNN and SDPA-flash (autotuned)
# kernels:   attention.py --timer kernels, gproj, none and cuDNN: each call's summed kernel time (torch.profiler),
#            no host launch time (not in "all"; after "attention" in the same call it reuses its compiled kernels):
#            results/speed_latest_kernels.json
# train:     benchmarks/train_step.py, both Llama configurations, arms cudnn gproj none (PROFILE_STEPS=2:
#            also 2 profiled steps per arm; their files can exceed what one device call returns)
# Never start "train" while other processes use the GPU (run 16: compile processes beside it inflated
# the cuDNN arm 3x): the phases here run one after another.
# Each phase has its own time limit (140 + 230 + 190 s) so that "all" ends inside the device tool's 600 s;
# the scripts write their JSON as they go, so a phase cut by its limit still returns what it measured.
# Everything lands in $OUT: logs, results/speed_latest.json, results/train_step_latest.json, profiles.
set -u
what=${1:-all}  # "attention kernels": both, the kernels table second
rm -rf /tmp/site  # a warm machine keeps the previous call's install; pip --target does not replace it
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p "$OUT/results"
python3 -c 'import torch, triton, lightning, transformers; print(torch.__version__, triton.__version__, lightning.__version__, transformers.__version__, torch.cuda.get_device_name())'
if [[ $what == all || $what == check ]]; then
  GPROJ_TRITON_AUTOTUNE=0 timeout 140 \
    python3 benchmarks/gpu_check.py > "$OUT/gpu_check_run10.log" 2>&1
  echo "check rc=$?"
fi
if [[ $what == all || $what == attention || $what == kernels ]]; then
  # Compiling every autotune candidate of every variant is CPU-bound and took most of run 10's limit:
  # 4 processes side by side fill Triton's cache first (their timings are discarded), so the timed run
  # below still autotunes, on compiled kernels.
  for s in 0,1 2,3 4,5 6,7; do
    timeout 150 python3 benchmarks/attention.py --out "/tmp/warm_$s" --methods gproj,none --shapes "$s" > /dev/null 2>&1 &
  done
  wait
fi
if [[ $what == all || $what == attention ]]; then
  timeout 230 python3 benchmarks/attention.py --out "$OUT/attention" --json "$OUT/results/speed_latest.json" \
    --methods gproj,none,cudnn,sdpa_flash > "$OUT/attention_run10.log" 2>&1
  echo "attention rc=$?"
fi
if [[ " $* " == *" kernels "* ]]; then
  timeout 200 python3 benchmarks/attention.py --timer kernels --out "$OUT/attention_kernels" \
    --json "$OUT/results/speed_latest_kernels.json" --methods gproj,none,cudnn > "$OUT/attention_kernels_run10.log" 2>&1
  echo "attention (kernels) rc=$?"
fi
if [[ $what == all || $what == train ]]; then
  timeout 190 python3 benchmarks/train_step.py --out "$OUT/results/train_step_latest.json" \
    --arms cudnn,gproj,none --warmup 5 --steps 15 --profile-steps "${PROFILE_STEPS:-0}" > "$OUT/train_step_run10.log" 2>&1
  echo "train rc=$?"
fi
rm -f "$OUT"/attention*/*.png  # the device tool returns at most 8 files
tail -n 5 "$OUT"/*_run10.log
