#!/usr/bin/env bash
# The data curve at scale, on a GPU: the target regenerates N ShareGPT first turns (bf16, in-process batched
# greedy), then one EAGLE-3 head per nested subset (benchmarks/data_curve.py: one held-out set, steps = epochs over
# the subset), then the table. Decode the heads where they are served (levers.py decode; llama.cpp: export --check).
#
#     bash benchmarks/gpu_data_curve.sh OUT                      # N=10000, subsets 196,825,2500,all, 3 epochs
#     N=4000 RECORDS=196,825,0 EPOCHS=4 bash benchmarks/gpu_data_curve.sh OUT
#     N=0 SAMPLES=1 RECORDS=0 EPOCHS=4 bash benchmarks/gpu_data_curve.sh OUT   # every first turn, 2 answers each
#
# SAMPLES=S adds S sampled target answers per prompt (data.regenerate.samples, temperature 0.7): the stored file has
# ~9.9k usable first turns, so past ~1.3M answer tokens more data means more answers per prompt. Their records follow
# the greedy ones, so RECORDS subsets up to the greedy count hold greedy answers only; held-out records may share a
# prompt with trained ones (held-out figures may flatter; decoded τ on MT-bench cannot).
# Batch sizes: regeneration batch RB (512: an H200 holds it with room), training batch TBS (32) at the demo's
# learning rate 2e-3 and TTT depth 2; 64 held-out records. Needs transformers >= 5.24 (target.MIN_TRANSFORMERS).
# On an H200 regeneration runs ~6k new tokens/s at RB=512 and training ~80k tokens/s: N=10000 takes ~4 min + ~4 min.
# Figures: benchmarks/RESULTS.md, "data curve" (the 1.28M-token GPU run: N=0 over 9,914 first turns, EPOCHS=4, HO=64).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_data_curve.sh OUT}
PY=${PYTHON:-python3}
N=${N:-10000}; RB=${RB:-512}; RECORDS=${RECORDS:-196,825,2500,0}; EPOCHS=${EPOCHS:-3}; MINSTEPS=${MINSTEPS:-150}
TBS=${TBS:-32}; HO=${HO:-64}; SAMPLES=${SAMPLES:-0}
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$OUT"
"$PY" -m draftsmith.cli prepare -c smollm2-135m-prepare "run_dir=$OUT/prepare" target.dtype=bfloat16 \
    "data.max_conversations=$N" data.render.max_length=512 data.vocab.size=8192 data.regenerate.max_new_tokens=160 \
    "data.regenerate.samples=$SAMPLES" "data.stages=[regenerate,tokenize,vocab]" "data.regenerate.batch_size=$RB" \
    "data.regenerate.shard_size=$((RB * 2))" data.render.num_proc=8 >"$OUT/prepare.log" 2>&1 || { tail -20 "$OUT/prepare.log"; exit 1; }
grep -A8 "^stage " "$OUT/prepare.log"
"$PY" benchmarks/data_curve.py train smollm2-135m-eagle3 "$OUT/curve" --records "$RECORDS" --epochs "$EPOCHS" \
    --min-steps "$MINSTEPS" target.dtype=bfloat16 "train.dataset=$OUT/prepare/data/tokenized" \
    "drafter.draft_vocab=$OUT/prepare/data/draft_vocab.safetensors" train.ttt_steps=2 train.optimizer.lr=0.002 \
    "train.batch_size=$TBS" train.max_length=512 "train.eval.heldout=$HO" train.eval.decoder_at_end=false
"$PY" benchmarks/data_curve.py table "$OUT"/curve/r*/ | tee "$OUT/curve.md"
