#!/usr/bin/env bash
# The issue-11 device calls on one H200 (benchmarks/NOTES.md runs 7-9; docs/reproduction.md), one call each:
#   bash benchmarks/repro_fp8_device.sh run7|run8|run9      (device tool: carry [".whl"], the wheels of
#   jsonargparse 4.53.0, docstring-parser 0.18.0, typeshed-client 2.15.0 for LightningCLI)
# run7: ds_format vs reference.py on the GPU, the DESIGN §6 sweep with FP8-significand dS, and the first arms
#       (key_bias_lr 1.0 seeds 1-2, 0.3 seed 1, a bf16-dS none arm); run8: three stronger settings, seed 1;
#       run9: the main setting's held-out seed 2. Arms share the GPU; logs land in $OUT/RUN.tgz (no checkpoints).
set -u
run=${1:?usage: repro_fp8_device.sh run7|run8|run9}
rm -rf /tmp/site  # a warm machine keeps the previous call's install; pip --target does not replace it
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 GPROJ_TRITON_AUTOTUNE=0 PYTHON=python3
export REPRO_CONFIG=examples/configs/repro_fp8.yaml
R=/tmp/$run; L=$R/logs; mkdir -p "$L"
arms() { bash examples/repro_arms.sh "$L" "$@"; }
case $run in
  run7)
    T="--trainer.max_time=00:00:07:20"
    arms kb1-s1 --model.key_bias_lr=1.0 $T &
    arms kb1-s2 --model.key_bias_lr=1.0 --seed_everything=2 --data.seed=2 $T &
    arms kb0.3-s1 --model.key_bias_lr=0.3 $T &
    python3 examples/gpt.py fit --config $REPRO_CONFIG --trainer.plugins.init_args.fix=none \
      --trainer.plugins.init_args.ds_format=bf16 --model.key_bias_lr=1.0 $T \
      --trainer.logger.init_args.save_dir="$L" --trainer.logger.init_args.name=kb1-s1-none_bf16 > "$L/kb1-s1-none_bf16.log" 2>&1 &
    sleep 20
    python3 benchmarks/gpu_check.py --ds-formats e4m3,e5m2 > "$R/gpu_check.log" 2>&1
    python3 benchmarks/fidelity.py --out "$R/fid" --methods gproj,none,gproj_e4m3,none_e4m3,gproj_e5m2,none_e5m2,cudnn \
      --mus 0,200,1000 > "$R/fidelity.log" 2>&1 ;;
  run8)
    T="--trainer.max_time=00:00:07:30"
    arms adamw-kb1-s1 --model.optimizer=adamw --model.key_bias_lr=1.0 $T &
    arms m03-e5m2-kb1-s1 --model.muon_lr=0.03 --trainer.plugins.init_args.ds_format=e5m2 --model.key_bias_lr=1.0 $T &
    arms e5m2-kb3-s1 --trainer.plugins.init_args.ds_format=e5m2 --model.key_bias_lr=3.0 $T & ;;
  run9)
    arms e5m2-kb3-s2 --trainer.plugins.init_args.ds_format=e5m2 --model.key_bias_lr=3.0 \
      --seed_everything=2 --data.seed=2 --trainer.max_time=00:00:06:00 & ;;
  *) echo "unknown run $run" >&2; exit 2 ;;
esac
wait
tar czf "$OUT/$run.tgz" --exclude='*.ckpt' -C "$R" .
for f in "$L"/*.log; do echo "$f"; tail -n 1 "$f"; done
