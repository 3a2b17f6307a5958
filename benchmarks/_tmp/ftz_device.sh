set -u
rm -rf /tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 GPROJ_TRITON_AUTOTUNE=0
for ftz in 0 1; do
  echo "== GPROJ_FTZ=$ftz t=${SECONDS}s"
  TRITON_CACHE_DIR=/tmp/tc_ftz$ftz GPROJ_FTZ=$ftz timeout 100 python3 benchmarks/attention.py --methods gproj,none --shapes 3,5 --softcap 30 --out "$OUT/ftz$ftz" > "$OUT/speed_ftz$ftz.log" 2>&1
  echo "rc=$?"; grep -E "TFLOP/s$" "$OUT/speed_ftz$ftz.log"
done
echo "== gpu_check base, FTZ t=${SECONDS}s"
timeout 150 python3 benchmarks/gpu_check.py --cases base > "$OUT/gpu_check_ftz.log" 2>&1; echo "rc=$?"
tail -30 "$OUT/gpu_check_ftz.log"
