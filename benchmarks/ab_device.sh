#!/usr/bin/env bash
# A/B of the attention kernels of two trees on the device, run alternately in separate processes: the
# working tree ("new") and an older tree unpacked into _old/ ("old"), e.g.
#   mkdir _old && git archive <rev> lightning_gproj kernels callbacks setup.cfg pyproject.toml benchmarks | tar -x -C _old
#   AB_SHAPES=3,5 AB_METHODS=gproj,none [AB_TIMER=kernels] [AB_ARGS="--softcap 30"] bash benchmarks/ab_device.sh [rounds]
# (delete _old afterwards; AB_ARGS: more attention.py arguments for both trees)
# Each tree is installed to its own --target directory and runs its own benchmarks/attention.py
# (GPROJ_TRITON_AUTOTUNE=0: the first candidate of each kernel). Output lines are prefixed ab_<tree>_<round>.
set -u
rounds=${1:-2}
repo=$(pwd)
rm -rf /tmp/site_new /tmp/site_old
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site_new . || exit 1
(cd _old && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site_old .) || exit 1
export GPROJ_TRITON_AUTOTUNE=0 PYTHONUNBUFFERED=1
for i in $(seq 1 "$rounds"); do
  for t in new old; do
    src=$repo; [ "$t" = old ] && src=$repo/_old
    (cd /tmp && PYTHONPATH=/tmp/site_$t python3 "$src/benchmarks/attention.py" --methods "${AB_METHODS:-gproj,none}" \
      --shapes "${AB_SHAPES:-3}" ${AB_TIMER:+--timer $AB_TIMER} ${AB_ARGS:-} --out "$OUT/ab_${t}_$i" 2>&1 | grep -E "TFLOP|rror" | sed "s/^/ab_${t}_$i: /")
  done
done
