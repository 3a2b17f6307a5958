#!/usr/bin/env bash
# The pending GPU measurements of run 17 (benchmarks/NOTES.md), one device call, nothing to carry:
#   bash benchmarks/gluon_device.sh
# 1. the Gluon forward probe: o against fp32, m / log2l against the package, TFLOP/s against the package and cuDNN;
# 2. the Gluon dK/dV probe: dk, dv against the package's fix="none" backward, TFLOP/s against its _dkdv_kernel;
# 3. softcap 30 after the dPᵀ-first change, against run 17's 144 / 208 TFLOP/s (AUTOTUNE=0, 1×16×8192×128 causal).
# Each step has its own limit, so that a probe that hangs (a barrier phase wrong) cannot take the call.
set -u
rm -rf /tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 120 python3 benchmarks/gluon_fwd_probe.py > "$OUT/gluon_fwd.log" 2>&1
echo "gluon fwd rc=$?"; tail -n 8 "$OUT/gluon_fwd.log"
timeout 120 python3 benchmarks/gluon_dkdv_probe.py > "$OUT/gluon_dkdv.log" 2>&1
echo "gluon dkdv rc=$?"; tail -n 6 "$OUT/gluon_dkdv.log"
GPROJ_TRITON_AUTOTUNE=0 timeout 200 python3 benchmarks/attention.py --out "$OUT/softcap" --methods gproj,none --shapes 3 \
  --softcap 30 > "$OUT/softcap.log" 2>&1
echo "softcap rc=$?"; rm -f "$OUT"/softcap/*.png; grep -A4 "fwd+bwd TFLOP" "$OUT/softcap/attention.md"
