#!/bin/bash
# The EAGLE-3 recipe sweep of RESULTS.md ("train", Recipe sweep; its tables: history/2026.md, "train"): short runs, one change each from the demo's recipe,
# on data prepared by `draftsmith demo` (or `draftsmith prepare`); the figures are the runs' held-out accuracies in
# OUT/<variant>/train_summary.json (load does not change them).
#   bash benchmarks/recipe_sweep.sh runs/demo/prepare/data runs/sweep [steps]
# Vocabulary variants need their files first: draftsmith prepare --config smollm2-135m-prepare
#   run_dir=OUT/v4096 data.stages=[vocab] data.vocab.size=4096 (with OUT/v4096/data/tokenized copied from DATA).
set -euo pipefail
DATA=${1:?prepared data folder (…/prepare/data)}; OUT=${2:?output folder}; STEPS=${3:-24}
run() {  # name, extra overrides
  local name=$1; shift
  [ -f "$OUT/$name/train_summary.json" ] && return
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} draftsmith train --config smollm2-135m-eagle3 run_dir="$OUT/$name" \
    train.dataset="$DATA/tokenized" train.features="$DATA/features" drafter.draft_vocab="$DATA/draft_vocab.safetensors" \
    train.steps="$STEPS" train.batch_size=4 train.max_length=512 train.ttt_steps=2 train.optimizer.lr=0.002 \
    train.schedule.warmup_steps=5 train.checkpoint.every=100 train.eval.every=100 train.eval.heldout=8 \
    train.eval.decoder_at_end=false train.logging.wandb=disabled "$@" > "$OUT/$name.log" 2>&1
  echo "$name: $(python -c "import json,sys; h=json.load(open(sys.argv[1]))['heldout']; print(h['heldout/top1_step0'], h['sim_tau'])" "$OUT/$name/train_summary.json")"
}
mkdir -p "$OUT"
run base
run lr5e-3 train.optimizer.lr=0.005
run ttt1 train.ttt_steps=1
run ce train.loss.kind=ce
for v in 4096 16384; do
  [ -f "$OUT/v$v/data/draft_vocab.safetensors" ] && run "vocab$v" drafter.draft_vocab="$OUT/v$v/data/draft_vocab.safetensors"
done
