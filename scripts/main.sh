#!/usr/bin/env bash
# README command 1, the main job: on a fresh 2-core machine without a GPU, install what is
# missing, build the CPU `nibble`, then pretrain the tiny OLMo-2 (configs/pretrain-tiny*.json:
# hidden 128, 4 layers, vocab 2048, 600 steps of 16x128 tokens on the KJV) twice, with the `bf16`
# baseline and with the full `tetrajet-v2` recipe (OutControl + OsciReset scaled to the short
# run, see docs/training.md), print both validation perplexities side by side and a sample from
# each. Outputs: runs/main/{bf16,tetrajet-v2}/ (metrics.jsonl, loss.png, checkpoints/), and
# runs/main/data/ (corpus, tokenizer, shards; shared by both runs). Takes ~10 minutes on 2 cores.
# Environment: NIBBLE_SKIP_SETUP=1 skips the package check; NIBBLE_MAIN_STEPS overrides the steps.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - START ))s] $*"; }

[ "${NIBBLE_SKIP_SETUP:-0}" = 1 ] || ./scripts/setup.sh

stamp "build: CPU, Release, target nibble (build/cpu)"
cmake -S . -B build/cpu -G Ninja -DNIBBLE_CUDA=OFF -DNIBBLE_BENCH=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cpu -j "$(nproc)" --target nibble
NIBBLE=build/cpu/bin/nibble

OUT=runs/main
mkdir -p "$OUT"
EXTRA=()
[ -n "${NIBBLE_MAIN_STEPS:-}" ] && EXTRA+=(--set "steps=${NIBBLE_MAIN_STEPS}")
THREADS=$(nproc)
# Idle OpenMP threads sleep instead of spinning: on a busy machine spinning threads make every
# barrier wait for a descheduled peer (measured 7x slower under load; equal speed when idle).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
declare -A CONFIG=([bf16]=configs/pretrain-tiny.json [tetrajet-v2]=configs/pretrain-tiny-tetrajet-v2.json)
declare -A SECONDS_TAKEN
for recipe in bf16 tetrajet-v2; do
  run="$OUT/$recipe"
  rm -rf "$run"   # a fresh run each time (the data folder is cached in $OUT/data)
  stamp "pretrain $recipe -> $run"
  t0=$(date +%s)
  "$NIBBLE" pretrain --config "${CONFIG[$recipe]}" --set "data.dir=$OUT/data" --set "threads=$THREADS" \
    "${EXTRA[@]}" --out "$run" | tee "$run.summary.txt"
  SECONDS_TAKEN[$recipe]=$(( $(date +%s) - t0 ))
done

stamp "validation perplexity (the same held-out KJV split, $("$NIBBLE" --version))"
printf '%-14s %12s %12s %10s\n' recipe val_loss val_ppl seconds
for recipe in bf16 tetrajet-v2; do
  json=$("$NIBBLE" eval --checkpoint "$OUT/$recipe" --data "$OUT/data/val.bin" --json)
  loss=$(echo "$json" | sed -E 's/.*"loss":([^,}]*).*/\1/')
  ppl=$(echo "$json" | sed -E 's/.*"ppl":([^,}]*).*/\1/')
  printf '%-14s %12.4f %12.3f %10s\n' "$recipe" "$loss" "$ppl" "${SECONDS_TAKEN[$recipe]}"
done

for recipe in bf16 tetrajet-v2; do
  stamp "sample from $recipe (seed 1, temperature 0.8, top-p 0.95)"
  "$NIBBLE" generate --checkpoint "$OUT/$recipe" --prompt "And God said" --max-new-tokens 48 --seed 1
done
stamp "done: plots $OUT/bf16/loss.png $OUT/tetrajet-v2/loss.png; checkpoints in $OUT/*/checkpoints/"
