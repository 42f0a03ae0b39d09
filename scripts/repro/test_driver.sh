#!/usr/bin/env bash
# Test of the reproduction's tooling on the CPU (ctest `repro_driver`, ~1 min on 2 cores): a
# small generated corpus goes through `nibble data tokenizer` / `nibble data shards`, is packed by
# pack_data.sh into two parts, and device.sh is called as the GPU machine would be, with the
# arms' own configs shrunk to a tiny model (NIBBLE_REPRO_SET): call 1 carries part 1 only (waits),
# call 2 carries part 2 (unpacks; three arms stop at step 2 with a checkpoint), call 3 resumes them
# and runs three more arms to the end. Then report.py regenerates the report from the returned
# metrics files and draws its figures with `nibble plot`.
#   scripts/repro/test_driver.sh path/to/nibble
set -euo pipefail
NIBBLE=$(realpath "${1:?usage: test_driver.sh path/to/nibble}")
SRC=$(cd "$(dirname "$0")/../.." && pwd)
T=$(mktemp -d)
trap '[ -n "${KEEP:-}" ] || rm -rf "$T"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# 1. Data: 60 documents of varied sentences, the last 6 as validation.
mkdir -p "$T/data"
for d in $(seq 1 60); do
  for l in $(seq 1 8); do
    echo "Document $d paragraph $l explains how the value $((d * l % 17)) moves the result of step $l forward."
  done
  echo
done >"$T/all.txt"
head -n 486 "$T/all.txt" >"$T/train.txt"
tail -n +487 "$T/all.txt" >"$T/val.txt"
"$NIBBLE" data tokenizer --vocab 300 --sample-lines 1000 --out "$T/data/tokenizer.model" "$T/train.txt" >/dev/null
"$NIBBLE" data shards --no-progress --tokenizer "$T/data/tokenizer.model" --out "$T/data/train.bin" "$T/train.txt" >/dev/null
"$NIBBLE" data shards --no-progress --tokenizer "$T/data/tokenizer.model" --out "$T/data/val.bin" "$T/val.txt" >/dev/null
bash "$SRC/scripts/repro/pack_data.sh" --part-size 1K --out "$T/packed" "$T/data/tokenizer.model" "$T/data/train.bin" \
  "$T/data/val.bin" >"$T/pack.txt"
parts=$(ls "$T/packed"/data.tar.xz.part-* | wc -l)
[ "$parts" -ge 2 ] || fail "expected >= 2 parts, got $parts"
grep -q "call 2: carry" "$T/pack.txt" || fail "pack_data.sh printed no carry list"
# --preset: a fast preset makes a stream the device unpacks the same way; a bad one is exit 2
bash "$SRC/scripts/repro/pack_data.sh" --preset -1 --out "$T/packed1" "$T/data/tokenizer.model" >/dev/null \
  || fail "pack_data.sh --preset -1 failed"
cat "$T/packed1"/data.tar.xz.part-* | xz -dc | tar -tf - | grep -qx tokenizer.model || fail "--preset -1 stream unreadable"
rc=0; bash "$SRC/scripts/repro/pack_data.sh" --preset fast --out "$T/packed2" "$T/data/tokenizer.model" 2>/dev/null || rc=$?
[ "$rc" = 2 ] || fail "pack_data.sh --preset fast: exit $rc, want 2"

# 2. The device calls; each "carries" the sha file and some parts.
export NIBBLE NIBBLE_REPRO_WORK=$T/work NIBBLE_REPRO_DEVICE=cpu
export NIBBLE_REPRO_SET="model=configs/tiny-dense.json seq_len=16 batch_size=2 steps=4 schedule.warmup_steps=1 eval.interval=2 eval.batches=2 checkpoint.interval=2 threads=1"
carry() {  # carry PART... : a fresh "repository" .repro with these parts
  rm -rf "$T/carry" && mkdir -p "$T/carry" && cp "$T/packed/data.sha256" "$T/carry/"
  for p in "$@"; do cp "$T/packed/$p" "$T/carry/"; done
}
first=$(cd "$T/packed" && ls data.tar.xz.part-* | head -1)
rest=$(cd "$T/packed" && ls data.tar.xz.part-* | tail -n +2)
carry "$first"
OUT=$T/out1 NIBBLE_REPRO_PARTS=$T/carry bash "$SRC/scripts/repro/device.sh" bf16-s1 >"$T/call1.log" 2>&1 || fail "call 1: $(cat "$T/call1.log")"
grep -q "1 of $parts parts" "$T/out1/repro.log" || fail "call 1 did not wait for the parts: $(cat "$T/out1/repro.log")"
[ ! -e "$T/out1/bf16-s1.metrics.jsonl" ] || fail "call 1 trained without data"

carry $rest
OUT=$T/out2 NIBBLE_REPRO_PARTS=$T/carry NIBBLE_REPRO_STOP_AFTER=2 bash "$SRC/scripts/repro/device.sh" bf16-s1 \
  nvfp4-nvidia-s1 tj-full-s1 >"$T/call2.log" 2>&1 || fail "call 2: $(cat "$T/out2/repro.log")"
for a in bf16-s1 nvfp4-nvidia-s1 tj-full-s1; do
  [ -f "$T/out2/$a.metrics.jsonl" ] || fail "call 2: no metrics for $a"
  grep '"event":"end"' "$T/out2/$a.metrics.jsonl" | grep -q '"step":2[,}]' || fail "call 2: $a should have stopped at step 2"
  [ -d "$T/work/runs/$a/checkpoints" ] || fail "call 2: $a left no checkpoint"
done

carry  # nothing carried: the data is on the "device disk" already
OUT=$T/out3 NIBBLE_REPRO_PARTS=$T/carry bash "$SRC/scripts/repro/device.sh" bf16-s1 nvfp4-nvidia-s1 tj-full-s1 \
  tj-base-s1 tj-outcontrol-s1 tj-oscireset-s1 >"$T/call3.log" 2>&1 || fail "call 3: $(cat "$T/out3/repro.log")"
for a in bf16-s1 nvfp4-nvidia-s1 tj-full-s1 tj-base-s1 tj-outcontrol-s1 tj-oscireset-s1; do
  grep '"event":"end"' "$T/out3/$a.metrics.jsonl" | grep -q '"step":4[,}]' || fail "call 3: $a did not complete"
done
for a in bf16-s1 nvfp4-nvidia-s1 tj-full-s1; do
  grep -q '"event":"resume"' "$T/out3/$a.metrics.jsonl" || fail "call 3: $a did not resume"
done
grep -q '"recipe.oscireset.resets_total"' "$T/out3/tj-full-s1.metrics.jsonl" || fail "no OsciReset counters in tj-full"
! grep -q 'oscireset' "$T/out3/tj-base-s1.metrics.jsonl" || fail "tj-base ran OsciReset"
[ "$(ls "$T/out3" | wc -l)" -le 8 ] || fail "more than 8 files come back"

# 3. The report from the returned metrics.
mkdir -p "$T/results/data"
cp "$T/out3"/*.metrics.jsonl "$T/results/data/"
printf '# report\n\nhand-written text\n\n<!-- generated:begin -->\nold\n<!-- generated:end -->\n\ntail\n' >"$T/results/r.md"
python3 "$SRC/scripts/repro/report.py" --data "$T/results/data" --report "$T/results/r.md" --nibble "$NIBBLE" \
  --steps 4 >/dev/null || fail "report.py failed"
grep -q "hand-written text" "$T/results/r.md" && grep -q "^tail" "$T/results/r.md" || fail "report.py lost the hand-written text"
! grep -q "^old" "$T/results/r.md" || fail "report.py kept the old generated part"
grep -q "| tj-full-s1 | tj-full | 1 | complete | 4/4 |" "$T/results/r.md" || fail "no run row for tj-full-s1"
# By definition bf16 closes the whole gap and nvfp4-nvidia none of it.
grep -q "| bf16 | 1 | .* | - | 1.000 |" "$T/results/r.md" || fail "bf16 gap row: $(grep '| bf16 |' "$T/results/r.md")"
grep -q "| nvfp4-nvidia | 1 | .* | - | 0.000 |" "$T/results/r.md" || fail "nvidia gap row: $(grep '| nvfp4-nvidia |' "$T/results/r.md")"
for f in val_loss val_loss_late train_loss oscireset_resets; do
  head -c 8 "$T/results/figures/$f.png" | od -c | grep -q 'P   N   G' || fail "no PNG $f"
done
echo "repro driver test: ok"
