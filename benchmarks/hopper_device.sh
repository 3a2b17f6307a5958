#!/usr/bin/env bash
# The sm_90 Gluon kernels (kernels/attention_fwd_hopper.py, kernels/attention_bwd_hopper.py) on one H200, one
# device call, nothing to carry:
#   bash benchmarks/hopper_device.sh [phase ...]     (default: check c2 base ab; train in a call of its own)
# check: gpu_check.py --cases hopper: the Gluon forward against reference.py and the tl.dot forward, the
#        backward fed its statistics, a heads-major case, the constants of DESIGN.md §5;
# c2:    gpu_check.py --skip-cases, autotuned: the constants and the op under autocast with an fp32 k, whose
#        C2 (Σ_j dK_j = 0 to fp32 rounding, ~1e-7) the PyTorch projection over the dK/dV kernel's key sums enforces;
# base:  gpu_check.py --cases base: the 8 base cases, every fix, Triton against reference.py (AUTOTUNE=0);
# bwdcheck: gpu_check.py --cases hopper_bwd: the Gluon backward passes against reference.py and the tl.dot ones;
# bwdab: backward A/B on the 8 shapes, fix gproj and none, AUTOTUNE=0: GPROJ_HOPPER_BWD=0 (tl.dot passes)
#        against the default (Gluon where served), cuDNN in the second run;
# ab:    forward A/B on the 8 shapes of attention.py, fix none, AUTOTUNE=0: GPROJ_HOPPER_FWD=0 (tl.dot)
#        against the default (Gluon where served), cuDNN in the second run;
# train: train_step.py, both Llama configurations, arms cudnn / gproj / none (nothing else on the GPU);
#        ROUNDS=R runs the arms R times in alternating order (train_step.py --rounds; limit 200·R s).
# softcap: gpu_check.py --cases hopper,hopper_bwd --hopper-softcap 30: the Gluon kernels with a logit softcap
#        against reference.py and the tl.dot kernels (AUTOTUNE=0); HOPPER_SOFTCAP (default 30) and HOPPER_WINDOW
#        (LEFT,RIGHT; default -1,-1) choose the softcap and the sliding window of every call, CHECK_LIMIT its limit;
# softcapfid: fidelity.py --quick --mus 0,200,1000 --softcap 30, gproj and none (AUTOTUNE=0);
# softcapspeed: attention.py --softcap 30 on 4×16×2048×128 full and causal, 1×16×8192×128 causal and
#        2×16×4096×64 causal, gproj and none, plain and capped side by side (AUTOTUNE=0, as run 18); SOFTCAP_ENV
#        (e.g. "GPROJ_HOPPER_FWD=0 GPROJ_HOPPER_BWD=0": the tl.dot kernels) is set for that phase;
# windowspeed: the same with --window 1024 instead of --softcap (SOFTCAP_ENV likewise); TIMER=kernels times both
#        with attention.py --timer kernels.
# varlen: gpu_check.py --cases hopper_varlen (packed sequences through the Gluon kernels; HOPPER_SOFTCAP / HOPPER_WINDOW
#        as for softcap, default none), then attention.py --varlen (AUTOTUNE=0): the default ragged lengths packed
#        (Gluon) against padded (tl.dot, key lengths), the same with GPROJ_HOPPER_FWD=0 GPROJ_HOPPER_BWD=0 (packed on
#        the tl.dot kernels), and 8 × 2048 packed against the dense (8, 2048) batch (Gluon both); VARLEN_RUNS (default
#        "gluon tldot equal") picks those runs, VARLEN_RUNS= none;
# ragged: gpu_check.py --cases hopper_ragged (the Gluon kernels at seqlens that are not a multiple of 128), then
#        attention.py --varlen with 8 × 1000 tokens (packed and the dense (8, 1000) batch) on the Gluon kernels and
#        on the tl.dot ones (GPROJ_HOPPER_FWD=0 GPROJ_HOPPER_BWD=0);
# Each phase has its own limit (check 100, c2 120, base 220, bwdcheck 300, ab and bwdab 2×100, train 200·R s,
# softcap 300, softcapfid 100, softcapspeed and windowspeed 130): pick phases so that they end inside 600 s.
set -u
phases=${*:-check c2 base ab}
rm -rf /tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p "$OUT/results"
for phase in $phases; do
  case $phase in
    check)
      GPROJ_TRITON_AUTOTUNE=0 timeout 100 python3 benchmarks/gpu_check.py --cases hopper > "$OUT/gpu_check_hopper.log" 2>&1
      echo "check rc=$?"; grep -E "hopper" "$OUT/gpu_check_hopper.log" ;;
    c2)
      timeout 120 python3 benchmarks/gpu_check.py --skip-cases > "$OUT/gpu_check_c2.log" 2>&1
      echo "c2 rc=$?"; grep -E "constant|autocast" "$OUT/gpu_check_c2.log" ;;
    base)
      GPROJ_TRITON_AUTOTUNE=0 timeout 220 python3 benchmarks/gpu_check.py --cases base > "$OUT/gpu_check_base.log" 2>&1
      echo "base rc=$?"; grep -E "worst|^\(" "$OUT/gpu_check_base.log" ;;
    ab)
      for f in 0 1; do
        methods=none; [[ $f == 1 ]] && methods=none,cudnn
        GPROJ_HOPPER_FWD=$f GPROJ_TRITON_AUTOTUNE=0 timeout 100 python3 benchmarks/attention.py --out "$OUT/fwd_hopper$f" \
          --methods "$methods" > "/tmp/fwd_hopper$f.log" 2>&1
        echo "fwd A/B GPROJ_HOPPER_FWD=$f rc=$?"; rm -f "$OUT/fwd_hopper$f"/*.png "$OUT/fwd_hopper$f"/*.json
        grep -A12 "### fwd TFLOP" "$OUT/fwd_hopper$f/attention.md"
      done ;;
    bwdcheck)
      GPROJ_TRITON_AUTOTUNE=0 timeout 300 python3 benchmarks/gpu_check.py --cases hopper_bwd > "$OUT/gpu_check_hopper_bwd.log" 2>&1
      echo "bwdcheck rc=$?"; grep -E "hopper_bwd" "$OUT/gpu_check_hopper_bwd.log" ;;
    bwdab)
      for f in 0 1; do
        methods=gproj,none; [[ $f == 1 ]] && methods=gproj,none,cudnn
        GPROJ_HOPPER_BWD=$f GPROJ_TRITON_AUTOTUNE=0 timeout 100 python3 benchmarks/attention.py --out "$OUT/bwd_hopper$f" \
          --methods "$methods" > "/tmp/bwd_hopper$f.log" 2>&1
        echo "bwd A/B GPROJ_HOPPER_BWD=$f rc=$?"; rm -f "$OUT/bwd_hopper$f"/*.png "$OUT/bwd_hopper$f"/*.json
        grep -B1 -A11 "### bwd TFLOP" "$OUT/bwd_hopper$f/attention.md"; grep -A11 "### fwd+bwd TFLOP" "$OUT/bwd_hopper$f/attention.md"
      done ;;
    train)
      timeout $((200 * ${ROUNDS:-1})) python3 benchmarks/train_step.py --out "$OUT/results/train_step_latest.json" --arms cudnn,gproj,none ${ROUNDS:+--rounds $ROUNDS} \
        --warmup 5 --steps 15 > "$OUT/train_step.log" 2>&1
      echo "train rc=$?"; grep -E "step .* ms" "$OUT/train_step.log"; tail -n 12 "$OUT/train_step.log" ;;
    softcap)
      w=${HOPPER_WINDOW:--1,-1}
      log="$OUT/gpu_check_hopper_softcap${HOPPER_SOFTCAP:-30}_window${w//,/_}.log"  # no comma: the device tool drops such names
      GPROJ_TRITON_AUTOTUNE=0 timeout ${CHECK_LIMIT:-300} python3 benchmarks/gpu_check.py --cases hopper,hopper_bwd \
        --hopper-softcap ${HOPPER_SOFTCAP:-30} --hopper-window=${HOPPER_WINDOW:--1,-1} > "$log" 2>&1
      echo "softcap rc=$?"; grep -E "hopper" "$log" ;;
    softcapfid)
      GPROJ_TRITON_AUTOTUNE=0 timeout 100 python3 benchmarks/fidelity.py --quick --mus 0,200,1000 --methods gproj,none \
        --softcap 30 --out "$OUT/fidelity_softcap" > "$OUT/fidelity_softcap.log" 2>&1
      echo "softcapfid rc=$?"; rm -f "$OUT/fidelity_softcap"/*.png; tail -n 30 "$OUT/fidelity_softcap.log" ;;
    softcapspeed|windowspeed)
      feature=${phase%speed}  # softcap or window
      flag="--softcap 30"; [[ $feature == window ]] && flag="--window 1024"
      tag=${SOFTCAP_ENV:+_tldot}
      env ${SOFTCAP_ENV:-} GPROJ_TRITON_AUTOTUNE=0 timeout 130 python3 benchmarks/attention.py --methods gproj,none --shapes 0,1,3,5 \
        $flag ${TIMER:+--timer $TIMER} --out "$OUT/speed_$feature$tag" > "$OUT/speed_$feature$tag.log" 2>&1
      echo "$phase ${SOFTCAP_ENV:-} rc=$?"; rm -f "$OUT/speed_$feature$tag"/*.png
      grep -B2 -A7 "TFLOP/s$" "$OUT/speed_$feature$tag/attention.md" ;;
    varlen)
      log="$OUT/gpu_check_hopper_varlen_softcap${HOPPER_SOFTCAP:-0}_window${HOPPER_WINDOW:--1,-1}.log"
      log=${log//,/_}
      GPROJ_TRITON_AUTOTUNE=0 timeout ${CHECK_LIMIT:-200} python3 benchmarks/gpu_check.py --cases hopper_varlen \
        --hopper-softcap ${HOPPER_SOFTCAP:-0} --hopper-window=${HOPPER_WINDOW:--1,-1} > "$log" 2>&1
      echo "varlen check rc=$?"; grep -E "hopper_varlen" "$log"
      for run in ${VARLEN_RUNS-gluon tldot equal}; do
        envs=""; lens=""
        [[ $run == tldot ]] && envs="GPROJ_HOPPER_FWD=0 GPROJ_HOPPER_BWD=0"
        [[ $run == equal ]] && lens="2048,2048,2048,2048,2048,2048,2048,2048"
        env $envs GPROJ_TRITON_AUTOTUNE=0 timeout 120 python3 benchmarks/attention.py --varlen $lens --out "$OUT/varlen_$run" \
          > "$OUT/speed_varlen_$run.log" 2>&1
        echo "varlen speed $run rc=$?"; grep -E "packed|padded|\|" "$OUT/speed_varlen_$run.log"
      done ;;
    ragged)
      GPROJ_TRITON_AUTOTUNE=0 timeout ${CHECK_LIMIT:-260} python3 benchmarks/gpu_check.py --cases hopper_ragged \
        > "$OUT/gpu_check_hopper_ragged.log" 2>&1
      echo "ragged check rc=$?"; grep -E "hopper" "$OUT/gpu_check_hopper_ragged.log"
      for run in gluon tldot; do
        envs=""; [[ $run == tldot ]] && envs="GPROJ_HOPPER_FWD=0 GPROJ_HOPPER_BWD=0"
        env $envs GPROJ_TRITON_AUTOTUNE=0 timeout 100 python3 benchmarks/attention.py --varlen 1000,1000,1000,1000,1000,1000,1000,1000 \
          --out "$OUT/ragged_$run" > "$OUT/speed_ragged_$run.log" 2>&1
        echo "ragged speed $run rc=$?"; grep -E "packed|padded|\|" "$OUT/speed_ragged_$run.log"
      done ;;
    *) echo "unknown phase $phase (check, c2, base, bwdcheck, ab, bwdab, train, softcap, softcapfid, softcapspeed, windowspeed, varlen, ragged)"; exit 2 ;;
  esac
done
