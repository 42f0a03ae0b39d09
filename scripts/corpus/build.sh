#!/usr/bin/env bash
# Builds the English pretraining corpus of the TetraJet-v2 reproduction (issue #14) from Debian
# main packages, on a machine with the Debian archive (not in CI: it downloads ~350 MB of
# packages, unpacks ~4 GB and cleans it, ~25 min on two busy cores), exactly as published in
# docs/results/corpus.md, so that every session's arms train on the same tokens:
#   1. apt-get download of the packages below into $CACHE/debs and `dpkg-deb -x` of each into
#      $CACHE/root/<package> (the files of an `apt-get install`, without installing anything:
#      nothing on the system changes, the package versions are recorded in $OUT/packages.tsv);
#   2. scripts/corpus/clean.py in the published two groups (duplicates are looked for within a
#      group): GROUP1 -> $OUT/g1/, GROUP2 -> $OUT/g2/ (train.txt, val.txt, stats.json); the
#      validation split is by a hash of each document id, so it does not depend on the grouping;
#   3. `nibble data tokenizer` on a seeded sample of group 1's train.txt (vocabulary $VOCAB) and
#      `nibble data shards` (streaming, bounded memory): train1.bin (group 1), train2.bin
#      (group 2), val.bin (group 1's then group 2's validation text), tokenizer.model;
#   4. the SHA-256 of the four files against scripts/corpus/published.sha256 (a mismatch is an
#      error: a different package version or cleaner gives a different corpus, and arms trained
#      on it are not comparable with the published ones). NIBBLE_CORPUS_NO_CHECK=1 skips it.
# Usage: scripts/corpus/build.sh [OUT (default runs/corpus)]; env CACHE (default $OUT/cache),
# NIBBLE (default build/cpu/bin/nibble), VOCAB (16384), SAMPLE_LINES (300000), SEED (1234).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/corpus}
CACHE=${CACHE:-$OUT/cache}
NIBBLE=${NIBBLE:-build/cpu/bin/nibble}
VOCAB=${VOCAB:-16384}
SAMPLE_LINES=${SAMPLE_LINES:-300000}
SEED=${SEED:-1234}
# Debian 12 main, English, prose-heavy documentation and dictionaries (licences: docs/results/corpus.md).
GROUP1=(debian-policy developers-reference postgresql-doc-15 python3.11-doc perl-doc
  manpages manpages-dev git-doc nodejs-doc python-django-doc octave-doc libreoffice-help-en-us
  lilypond-doc-html linux-doc-6.1 dict-gcide wordnet-base erlang-doc racket-doc python-pandas-doc
  python-scipy-doc python-statsmodels-doc sagemath-doc ghc-doc openjdk-17-doc rust-doc)
GROUP2=(libboost1.81-doc cmake-doc llvm-15-doc clang-15-doc python-sqlalchemy-doc sphinx-doc
  python-astropy-doc python-sklearn-doc fp-docs-3.2.2 postfix-doc exim4-doc-html bind9-doc zsh-doc bash-doc
  python-sympy-doc python-scrapy-doc python-werkzeug-doc python-flask-doc python-requests-doc
  python-setuptools-doc maxima-doc gimp-help-en)
PACKAGES=("${GROUP1[@]}" "${GROUP2[@]}")
[ -x "$NIBBLE" ] || { echo "build.sh: no nibble binary at $NIBBLE (build the nibble target)" >&2; exit 1; }
mkdir -p "$CACHE/debs" "$CACHE/root" "$OUT"

echo "== 1. packages"
(cd "$CACHE/debs" && apt-get download "${PACKAGES[@]}")
printf 'package\tversion\tlicence (debian/copyright License: fields)\n' >"$OUT/packages.tsv"
for p in "${PACKAGES[@]}"; do
  deb=$(ls "$CACHE/debs/${p}"_*.deb | head -1)
  if [ ! -d "$CACHE/root/$p" ]; then
    mkdir -p "$CACHE/root/$p.tmp" && dpkg-deb -x "$deb" "$CACHE/root/$p.tmp" && mv "$CACHE/root/$p.tmp" "$CACHE/root/$p"
  fi
  # (|| true: a copyright file without License: fields, dict-gcide's, is no error)
  lic=$( (find "$CACHE/root/$p/usr/share/doc" -name copyright -exec grep -h '^License:' {} + 2>/dev/null || true) \
    | sed 's/^License: *//' | sort -u | paste -sd ';' -)
  printf '%s\t%s\t%s\n' "$p" "$(dpkg-deb -f "$deb" Version)" "${lic:-see /usr/share/doc/$p/copyright}" >>"$OUT/packages.tsv"
done

echo "== 2. clean text (two groups, in parallel)"
python3 scripts/corpus/clean.py --root "$CACHE/root" --out "$OUT/g1" --packages "${GROUP1[@]}" &
g1=$!
python3 scripts/corpus/clean.py --root "$CACHE/root" --out "$OUT/g2" --packages "${GROUP2[@]}" || { kill "$g1"; exit 1; }
wait "$g1"

echo "== 3. tokenizer and shards"
"$NIBBLE" data tokenizer --vocab "$VOCAB" --sample-lines "$SAMPLE_LINES" --seed "$SEED" --out "$OUT/tokenizer.model" \
  "$OUT/g1/train.txt"
"$NIBBLE" data shards --tokenizer "$OUT/tokenizer.model" --out "$OUT/train1.bin" "$OUT/g1/train.txt"
"$NIBBLE" data shards --tokenizer "$OUT/tokenizer.model" --out "$OUT/train2.bin" "$OUT/g2/train.txt"
"$NIBBLE" data shards --tokenizer "$OUT/tokenizer.model" --out "$OUT/val.bin" "$OUT/g1/val.txt" "$OUT/g2/val.txt"

echo "== 4. checksums"
(cd "$OUT" && sha256sum tokenizer.model train1.bin train2.bin val.bin) | tee "$OUT/corpus.sha256"
if [ "${NIBBLE_CORPUS_NO_CHECK:-0}" != 1 ]; then
  if diff <(sed 's/ .*//' scripts/corpus/published.sha256) <(sed 's/ .*//' "$OUT/corpus.sha256") >/dev/null; then
    echo "build.sh: the corpus is the published one (scripts/corpus/published.sha256)"
  else
    echo "build.sh: the corpus differs from the published one (scripts/corpus/published.sha256 vs $OUT/corpus.sha256)" >&2
    exit 1
  fi
fi
ls -l "$OUT"
