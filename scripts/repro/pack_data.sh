#!/usr/bin/env bash
# Packs the reproduction's data for the GPU machine (issue #14): FILES (tokenizer.model plus either
# the token shards train.bin/val.bin or the clean text train.txt/val.txt) go into one xz stream,
# cut into parts of at most --part-size (split -b units; default 40M = 40 MiB) under .repro/ (git-ignored):
# .repro/data.tar.xz.part-aa, -ab, ... and .repro/data.sha256 ("<sha256 of the whole stream>
# <number of parts>"). A device call carries .gpubin (the ~20 MiB binary bundle), .repro/data.sha256
# and one part (64 MiB per call in all); scripts/repro/device.sh keeps the parts on the device disk
# and unpacks them once all are there. Prints the carry list of each call.
#   scripts/repro/pack_data.sh [--part-size SIZE] [--preset XZ_PRESET] [--out DIR] FILE...   (FILEs of one folder)
# --preset (default -9e, the smallest stream) takes any xz preset: -1 packs the 100 MB of token
# shards in seconds instead of tens of minutes on a busy 2-core machine, for a few MB more.
set -euo pipefail
PART_SIZE=${PART_SIZE:-40M}
OUTDIR=.repro
PRESET=-9e
while [ "$#" -gt 0 ]; do
  case $1 in
    --part-size) PART_SIZE=$2; shift 2;;
    --out) OUTDIR=$2; shift 2;;
    --preset) PRESET=$2; shift 2;;
    *) break;;
  esac
done
[ "$#" -ge 1 ] || { echo "usage: pack_data.sh [--part-size SIZE] [--preset XZ_PRESET] [--out DIR] FILE..." >&2; exit 2; }
for f in "$@"; do [ -f "$f" ] || { echo "pack_data.sh: no file $f" >&2; exit 1; }; done
mkdir -p "$OUTDIR"
rm -f "$OUTDIR"/data.tar.xz.part-* "$OUTDIR/data.sha256"
# -T1 keeps the stream identical across machines; -9e: the text/shards compress best this way.
case $PRESET in -[0-9]|-[0-9]e) ;; *) echo "pack_data.sh: --preset must be an xz preset such as -1 or -9e" >&2; exit 2;; esac
tar -cf - --owner=0 --group=0 --numeric-owner --mtime=@0 --sort=name -C "$(dirname "$1")" \
  $(for f in "$@"; do basename "$f"; done) | xz -T1 "$PRESET" -c >"$OUTDIR/data.tar.xz"
sha=$(sha256sum "$OUTDIR/data.tar.xz" | cut -d' ' -f1)
split -b "$PART_SIZE" -a 2 "$OUTDIR/data.tar.xz" "$OUTDIR/data.tar.xz.part-"
rm "$OUTDIR/data.tar.xz"
n=$(ls "$OUTDIR"/data.tar.xz.part-* | wc -l)
echo "$sha $n" >"$OUTDIR/data.sha256"
i=0
for p in "$OUTDIR"/data.tar.xz.part-*; do
  i=$((i + 1))
  echo "call $i: carry [\".gpubin\", \"$OUTDIR/data.sha256\", \"$p\"]  ($(stat -c %s "$p") bytes)"
done
