#!/usr/bin/env bash
# benchmarks/config_sweep.py on the device: N processes side by side fill Triton's cache (compiling is
# CPU-bound and dominates), then one process times every candidate with the cache warm.
#   bash benchmarks/sweep_device.sh [config_sweep.py flags...]     (writes $OUT/config_sweep.{json,log})
# Needs the package importable (PYTHONPATH) and GPROJ_TRITON_AUTOTUNE=0 in the environment.
set -u
n=${SWEEP_WORKERS:-8}
for k in $(seq 0 $((n - 1))); do
  python3 benchmarks/config_sweep.py --warm "$k/$n" "$@" > "$OUT/config_sweep_warm$k.txt" 2>&1 &
done
wait
python3 benchmarks/config_sweep.py --json "$OUT/config_sweep.json" "$@" > "$OUT/config_sweep.log" 2>&1
echo "sweep rc=$?"
tail -n 3 "$OUT/config_sweep_warm0.txt"
rm -f "$OUT"/config_sweep_warm*.txt
