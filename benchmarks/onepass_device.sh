#!/usr/bin/env bash
# benchmarks/onepass_probe.py on the device: 12 processes side by side fill Triton's cache (compiling is
# CPU-bound), then one process checks and times every (shape, mask, fix, config) with the cache warm.
#   bash benchmarks/onepass_device.sh [onepass_probe.py flags...]   (writes $OUT/onepass.{json,log})
set -u
rm -rf /tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site GPROJ_TRITON_AUTOTUNE=0 PYTHONUNBUFFERED=1
n=${ONEPASS_WORKERS:-12}
for k in $(seq 0 $((n - 1))); do
  timeout 300 python3 benchmarks/onepass_probe.py --warm "$k/$n" "$@" > "$OUT/onepass_warm$k.txt" 2>&1 &
done
wait
cat "$OUT"/onepass_warm*.txt | grep -h -E "compiled|rror" | cut -c1-400 | tail -n 60
rm -f "$OUT"/onepass_warm*.txt
timeout 250 python3 benchmarks/onepass_probe.py --json "$OUT/onepass.json" "$@" > "$OUT/onepass.log" 2>&1
echo "probe rc=$?"
tail -n 60 "$OUT/onepass.log"
