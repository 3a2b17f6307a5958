#!/usr/bin/env bash
# Run the three arms of docs/reproduction.md side by side (one process each, same GPU, same seed).
# Usage: bash examples/repro_arms.sh LOGDIR LABEL [extra gpt.py fit arguments...]
# Logs: LOGDIR/LABEL-{none,gproj,fp32}/version_0/metrics.csv and LOGDIR/LABEL-{arm}.log.
# Example (one H200): bash examples/repro_arms.sh logs/repro_h200 kb1e-2 --model.key_bias_lr=1e-2
# The interpreter is $PYTHON (default: python). Exits 1 and names the failed arms' logs if any arm fails.
set -u
logdir=$1; label=$2; shift 2
mkdir -p "$logdir"
config=${REPRO_CONFIG:-examples/configs/repro_h200.yaml}
pids=(); arms=()
for arm in none gproj fp32; do
  case $arm in
    fp32) arm_args=(--trainer.plugins.init_args.attention_dtype=fp32) ;;
    *) arm_args=(--trainer.plugins.init_args.fix=$arm) ;;
  esac
  "${PYTHON:-python}" examples/gpt.py fit --config "$config" "${arm_args[@]}" \
    --trainer.logger.init_args.save_dir="$logdir" --trainer.logger.init_args.name="$label-$arm" "$@" \
    > "$logdir/$label-$arm.log" 2>&1 &
  pids+=($!); arms+=("$arm")
done
status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "repro_arms.sh: arm ${arms[$i]} failed; see $logdir/$label-${arms[$i]}.log" >&2
    status=1
  fi
done
exit $status
