#!/usr/bin/env bash
# Data-parallel weak scaling of `nibble pretrain` (issue #17 item 4): the same per-rank micro-batch
# (batch_size = MICRO x N) on world sizes N = 1, 2, 4, ... under mpirun, one rank per process
# (CPU: MPI; --device cuda: one GPU per rank, NCCL), and the weak-scaling efficiency
#   eff(N) = tokens_s(N) / (N * tokens_s(1)).
# tokens/s of a run: its metrics.jsonl, from the end of step WARMUP to the last step
# (elapsed_s is taken at the same point of every step; validation and checkpoints only at the end).
# Prints one JSON line per world size, then a table; the runs' logs and metrics stay under OUT
# (their checkpoints are deleted).
# Usage: scripts/dp_scaling.sh [--nibble BIN] [--config RUN_CONFIG] [--model MODEL_CONFIG]
#          [--device cpu|cuda] [--micro-batch B] [--seq T] [--steps S] [--warmup W]
#          [--worlds "1 2 4 8"] [--recipe NAME] [--data "FILES..."] [--out DIR] [--mpirun "mpirun ARGS"]
#          [--launcher mpirun|env] [--tokenizer-vocab V]
# --launcher env starts the N ranks itself with RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
# (torchrun style: NCCL with --device cuda, no mpirun needed; CPU ranks need mpirun).
# Defaults: configs/pretrain-tiny.json, cpu, B 4, T 64, S 8, W 2, worlds "1 2", this repository's
# docs as the corpus with a tokenizer of V = 2048 pieces (what that corpus allows; the model's
# vocab_size, which sets the lm_head's cost, is unchanged), OUT=runs/dp_scaling. On 8 H200s (370M shape):
#   scripts/dp_scaling.sh --device cuda --model configs/olmo2-370m.json --micro-batch 8 --seq 4096 \
#     --steps 12 --warmup 4 --worlds "1 2 4 8"
set -euo pipefail
cd "$(dirname "$0")/.."
NIBBLE=build/cpu/bin/nibble CONFIG=configs/pretrain-tiny.json MODEL="" DEVICE=cpu MICRO=4 SEQ=64 STEPS=8 WARMUP=2
WORLDS="1 2" RECIPE="" DATA="" OUT=runs/dp_scaling
MPIRUN="mpirun --oversubscribe$([ "$(id -u)" = 0 ] && echo " --allow-run-as-root")"
LAUNCHER=mpirun
VOCAB=2048
usage() { sed -n '2,20p' "$0" >&2; exit 2; }
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || usage
  case $1 in
    --nibble) NIBBLE=$2;; --config) CONFIG=$2;; --model) MODEL=$2;; --device) DEVICE=$2;;
    --micro-batch) MICRO=$2;; --seq) SEQ=$2;; --steps) STEPS=$2;; --warmup) WARMUP=$2;; --worlds) WORLDS=$2;;
    --recipe) RECIPE=$2;; --data) DATA=$2;; --out) OUT=$2;; --mpirun) MPIRUN=$2;; --launcher) LAUNCHER=$2;;
    --tokenizer-vocab) VOCAB=$2;;
    *) echo "dp_scaling.sh: unknown option $1" >&2; usage;;
  esac
  shift 2
done
for v in "$MICRO" "$SEQ" "$STEPS" "$WARMUP" "$VOCAB" $WORLDS; do
  [[ $v =~ ^[0-9]+$ ]] || { echo "dp_scaling.sh: '$v' is not a count" >&2; exit 2; }
done
case $LAUNCHER in mpirun|env) ;; *) echo "dp_scaling.sh: --launcher $LAUNCHER: mpirun or env" >&2; exit 2;; esac
[ "$WARMUP" -lt "$STEPS" ] || { echo "dp_scaling.sh: --warmup $WARMUP must be below --steps $STEPS" >&2; exit 2; }
[ -x "$NIBBLE" ] || { echo "dp_scaling.sh: no nibble binary at $NIBBLE (--nibble)" >&2; exit 1; }
if [ -z "$DATA" ]; then DATA=$(ls "$PWD"/docs/*.md "$PWD"/README.md); fi
data_json=$(printf '%s\n' $DATA | python3 -c 'import sys, json; print(json.dumps([l.strip() for l in sys.stdin if l.strip()]))')
mkdir -p "$OUT"
sets=(--set steps="$STEPS" --set seq_len="$SEQ" --set schedule.warmup_steps=1 --set eval.interval=0
      --set eval.batches=1 --set checkpoint.interval=0 --set "data.files=$data_json" --set data.dir="$OUT/data"
      --set data.vocab_size="$VOCAB")
[ -n "$MODEL" ] && sets+=(--set "model=$MODEL")
[ -n "$RECIPE" ] && sets+=(--set "recipe=$RECIPE")
# N ranks of `nibble ARGS...` (all output to $log): under mpirun, or as N processes of an env world
launch() {
  local n=$1 log=$2 r rc=0 pids=()
  shift 2
  if [ "$LAUNCHER" = mpirun ]; then
    # shellcheck disable=SC2086  # MPIRUN is a command line
    $MPIRUN -np "$n" "$NIBBLE" "$@" >"$log" 2>&1
    return
  fi
  for ((r = 0; r < n; r++)); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29600 + n)) "$NIBBLE" "$@" \
      >"$log.rank$r" 2>&1 &
    pids+=($!)
  done
  for r in "${!pids[@]}"; do wait "${pids[$r]}" || rc=$?; done
  cat "$log".rank* >"$log"
  rm -f "$log".rank*
  return $rc
}
results=()
for n in $WORLDS; do
  run=$OUT/world$n
  rm -rf "$run"
  if ! launch "$n" "$OUT/world$n.log" pretrain --config "$CONFIG" --device "$DEVICE" "${sets[@]}" \
      --set batch_size=$((MICRO * n)) --no-progress --out "$run"; then
    echo "dp_scaling.sh: world $n failed; the last lines of $OUT/world$n.log:" >&2
    tail -5 "$OUT/world$n.log" >&2
    exit 1
  fi
  rm -rf "$run/checkpoints"  # the end-of-run checkpoint (pretrain always writes one): not needed here
  results+=("$n:$run/metrics.jsonl")
done
python3 - "$MICRO" "$SEQ" "$WARMUP" "$DEVICE" "$CONFIG" "${MODEL:-}" "${results[@]}" <<'PY'
import json, sys
micro, seq, warmup, device, config, model = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
rows, base = [], None
for item in sys.argv[7:]:
    n, path = item.split(":", 1)
    n = int(n)
    steps = {r["step"]: r for r in map(json.loads, open(path)) if "elapsed_s" in r}
    last = max(steps)
    if warmup not in steps or last <= warmup:
        sys.exit(f"dp_scaling.sh: {path}: steps {warmup} and a later one are needed, got {sorted(steps)}")
    tokens = (last - warmup) * micro * n * seq
    tps = tokens / (steps[last]["elapsed_s"] - steps[warmup]["elapsed_s"])
    if base is None and n == 1:
        base = tps
    row = {"bench": "dp_scaling", "device": device, "config": config, "model": model or None, "world": n,
           "micro_batch": micro, "seq": seq, "timed_steps": last - warmup, "tokens_per_s": tps,
           "tokens_per_s_per_rank": tps / n, "efficiency": tps / (n * base) if base else None}
    rows.append(row)
    print(json.dumps(row))
print(f"{'world':>5} {'tokens/s':>12} {'per rank':>12} {'efficiency':>10}", file=sys.stderr)
for r in rows:
    eff = f"{100 * r['efficiency']:.1f}%" if r["efficiency"] is not None else "-"
    print(f"{r['world']:>5} {r['tokens_per_s']:>12.1f} {r['tokens_per_s_per_rank']:>12.1f} {eff:>10}", file=sys.stderr)
PY
