#!/usr/bin/env bash
# The TetraJet-v2 reproduction (issue #14) on the GPU machine: one device call runs
#   bash scripts/repro/device.sh ARM [ARM ...]
# from the repository root. It (1) unpacks the binary bundle (.gpubin/bundle.tar.xz) once,
# (2) gathers the corpus parts this call carried (.repro/data.tar.xz.part-*, written by
# scripts/repro/pack_data.sh) onto the device disk ($NIBBLE_REPRO_WORK, default /tmp/nibble-repro)
# and, once every part named in .repro/data.sha256 is there, checks and unpacks them
# (tokenizer.model, train*.bin, val.bin; or train.txt/val.txt, tokenized here), (3) trains the named arms in order, each from
# scripts/repro/base.json plus scripts/repro/arms/ARM.args (one `key=value` --set per line),
# resuming an unfinished arm from its checkpoint on the device disk, stopping the running arm with
# SIGINT (checkpoint, exit 130) before the call's time is up, and (4) copies each arm's
# metrics.jsonl to $OUT/ARM.metrics.jsonl and a log to $OUT/repro.log (at most 7 arms per call:
# 8 files come back). A call with no ARM only gathers data. Environment:
#   NIBBLE_REPRO_BUDGET_S   seconds this call may take in all (default 560; a device call has 600)
#   NIBBLE_REPRO_WORK       device-disk folder for data, prepared data and runs (default /tmp/nibble-repro)
#   NIBBLE_REPRO_PARTS      folder with the carried parts (default .repro)
#   NIBBLE                  the nibble binary (default: the bundle's .gpubin/nibble)
#   NIBBLE_REPRO_SET        extra `key=value` overrides for every arm, space-separated (the CPU test's tiny run)
#   NIBBLE_REPRO_DEVICE     --device for nibble (default: nibble's own, cuda:0 when a GPU is present)
#   NIBBLE_REPRO_STOP_AFTER pass --stop-after N (tests of the resume path)
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
START=$(date +%s)
OUT=${OUT:-$ROOT/repro_out}
WORK=${NIBBLE_REPRO_WORK:-/tmp/nibble-repro}
PARTS=${NIBBLE_REPRO_PARTS:-$ROOT/.repro}
BUDGET=${NIBBLE_REPRO_BUDGET_S:-560}
mkdir -p "$OUT" "$WORK/parts" "$WORK/runs"
log() { echo "== [$(($(date +%s) - START))s] $*" | tee -a "$OUT/repro.log"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }

if [ "$#" -gt 7 ]; then
  echo "device.sh: at most 7 arms per call (8 files come back: one metrics file per arm + repro.log)" >&2
  exit 2
fi
for arm in "$@"; do
  [ -f "scripts/repro/arms/$arm.args" ] || { echo "device.sh: no arm '$arm' (scripts/repro/arms/*.args)" >&2; exit 2; }
done

# 1. The binary.
if [ -z "${NIBBLE:-}" ]; then
  if [ ! -x .gpubin/nibble ] && [ -f .gpubin/bundle.tar.xz ]; then
    tar -C .gpubin -xJf .gpubin/bundle.tar.xz || { log "cannot unpack .gpubin/bundle.tar.xz"; exit 1; }
  fi
  export LD_LIBRARY_PATH="$ROOT/.gpubin/lib:${LD_LIBRARY_PATH:-}"
  NIBBLE=$ROOT/.gpubin/nibble
fi
[ -x "$NIBBLE" ] || { log "no nibble binary at $NIBBLE (carry .gpubin, built by scripts/gpu_bundle.sh)"; exit 1; }
log "nibble $NIBBLE, work $WORK, budget ${BUDGET}s, arms: ${*:-none}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/repro.log"

# 2. The data: parts carried by this call are kept on the device disk until all are there.
DATA=$WORK/data
if ! ls "$DATA"/train*.bin >/dev/null 2>&1; then
  [ -f "$PARTS/data.sha256" ] && cp "$PARTS/data.sha256" "$WORK/parts/"
  for p in "$PARTS"/data.tar.xz.part-*; do [ -f "$p" ] && cp "$p" "$WORK/parts/" && log "got part $(basename "$p")"; done
  if [ ! -f "$WORK/parts/data.sha256" ]; then log "no .repro/data.sha256 carried yet: carry it with the first part"; exit 1; fi
  read -r want_sha want_parts <"$WORK/parts/data.sha256"
  have=$(find "$WORK/parts" -name 'data.tar.xz.part-*' | wc -l)
  if [ "$have" -lt "$want_parts" ]; then
    log "data: $have of $want_parts parts on the device disk; carry the next part in the next call"
    exit 0
  fi
  got_sha=$(cat "$WORK/parts"/data.tar.xz.part-* | sha256sum | cut -d' ' -f1)
  if [ "$got_sha" != "$want_sha" ]; then log "data: sha256 mismatch ($got_sha, want $want_sha)"; exit 1; fi
  mkdir -p "$DATA.tmp" && cat "$WORK/parts"/data.tar.xz.part-* | xz -dc | tar -C "$DATA.tmp" -xf - \
    && mv "$DATA.tmp" "$DATA" || { log "data: cannot unpack"; exit 1; }
  # Compressed text instead of shards: tokenize here with the project's pipeline.
  if ! ls "$DATA"/train*.bin >/dev/null 2>&1 && [ -f "$DATA/train.txt" ]; then
    "$NIBBLE" data shards --tokenizer "$DATA/tokenizer.model" --out "$DATA/train.bin" --no-progress "$DATA/train.txt" \
      | tee -a "$OUT/repro.log" && "$NIBBLE" data shards --tokenizer "$DATA/tokenizer.model" --out "$DATA/val.bin" \
      --no-progress "$DATA/val.txt" | tee -a "$OUT/repro.log" || { log "data: tokenizing failed"; exit 1; }
    rm -f "$DATA/train.txt" "$DATA/val.txt"
  fi
  rm -rf "$WORK/parts"
  log "data ready: $(ls -l "$DATA" | tail -n +2 | awk '{printf "%s %s  ", $9, $5}')"
fi

# 3. The arms, in order; each resumes from its checkpoint when a previous call stopped it.
EXTRA=()
for kv in ${NIBBLE_REPRO_SET:-}; do EXTRA+=(--set "$kv"); done
DEV=()
[ -n "${NIBBLE_REPRO_DEVICE:-}" ] && DEV=(--device "$NIBBLE_REPRO_DEVICE")
STOP=()
[ -n "${NIBBLE_REPRO_STOP_AFTER:-}" ] && STOP=(--stop-after "$NIBBLE_REPRO_STOP_AFTER")
# An arm is complete when its metrics hold an "end" event at the last step (--stop-after also
# ends with an "end" event, at an earlier step).
TOTAL=$(sed -n 's/^ *"steps": *\([0-9]*\).*/\1/p' scripts/repro/base.json)
for kv in ${NIBBLE_REPRO_SET:-}; do case $kv in steps=*) TOTAL=${kv#steps=};; esac; done
status=0
for arm in "$@"; do
  run=$WORK/runs/$arm
  if [ -f "$run/metrics.jsonl" ] && grep '"event":"end"' "$run/metrics.jsonl" | grep -q "\"step\":$TOTAL[,}]"; then
    log "$arm: already complete"
  elif [ "$(left)" -lt 90 ]; then
    log "$arm: not started, $(left)s left in this call"
  else
    SETS=()
    while IFS= read -r kv; do [ -n "$kv" ] && SETS+=(--set "$kv"); done <"scripts/repro/arms/$arm.args"
    RESUME=()
    [ -d "$run/checkpoints" ] && RESUME=(--resume)
    limit=$(($(left) - 45))  # room for the last step, the checkpoint and the copies
    log "$arm: ${RESUME[*]:-fresh} for at most ${limit}s"
    # --preserve-status: nibble's own exit code (130 after a clean SIGINT stop, 137 if killed).
    timeout --preserve-status -s INT -k 60 "$limit" "$NIBBLE" pretrain --config scripts/repro/base.json "${SETS[@]}" "${EXTRA[@]}" \
      --data "$DATA"/train*.bin --set "data.tokenizer=$DATA/tokenizer.model" --set "data.val_files=[\"$DATA/val.bin\"]" \
      --set "data.dir=$WORK/prepared" --out "$run" "${RESUME[@]}" "${DEV[@]}" "${STOP[@]}" --no-progress \
      >"$WORK/$arm.stdout" 2>"$WORK/$arm.stderr"
    rc=$?
    tail -n 3 "$WORK/$arm.stderr" "$WORK/$arm.stdout" >>"$OUT/repro.log"
    case $rc in
      0) log "$arm: stopped cleanly at step $(grep '"event":"end"' "$run/metrics.jsonl" | tail -1 | sed 's/.*"step":\([0-9]*\).*/\1/') of $TOTAL";;
      130) log "$arm: interrupted at the call's time limit, checkpointed; resumes in the next call";;
      *) log "$arm: failed with exit code $rc"; status=1;;
    esac
  fi
  [ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$OUT/$arm.metrics.jsonl"
done
log "done"
exit $status
