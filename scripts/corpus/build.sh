#!/usr/bin/env bash
# Builds the English pretraining corpus of the TetraJet-v2 reproduction (issue #14) from Debian
# main packages, once, on a machine with the Debian archive (not in CI: it downloads ~350 MB of
# packages (~550 MB) and cleans ~5 GB of HTML, ~30 min on one free core):
#   1. apt-get download of the packages below into $CACHE/debs and `dpkg-deb -x` of each into
#      $CACHE/root/<package> (the files of an `apt-get install`, without installing anything:
#      no root needed, nothing on the system changes, the package versions are recorded);
#   2. scripts/corpus/clean.py: markup to prose, code and boilerplate dropped, exact and near
#      duplicates dropped, the validation split by a hash of each document id ->
#      $OUT/train.txt, $OUT/val.txt, $OUT/stats.json;
#   3. `nibble data tokenizer` on a seeded sample of train.txt (vocabulary $VOCAB) and
#      `nibble data shards` for both sides (streaming, bounded memory) -> $OUT/tokenizer.model,
#      $OUT/train.bin, $OUT/val.bin; the licences and package versions -> $OUT/packages.tsv.
# Usage: scripts/corpus/build.sh [OUT (default runs/corpus)]; env CACHE (default $OUT/cache),
# NIBBLE (default build/cpu/bin/nibble), VOCAB (16384), SAMPLE_LINES (300000), SEED (1234).
# docs/results/corpus.md records what one run produced.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/corpus}
CACHE=${CACHE:-$OUT/cache}
NIBBLE=${NIBBLE:-build/cpu/bin/nibble}
VOCAB=${VOCAB:-16384}
SAMPLE_LINES=${SAMPLE_LINES:-300000}
SEED=${SEED:-1234}
# Debian main, English, prose-heavy documentation and dictionaries (licences: docs/results/corpus.md).
PACKAGES=(debian-policy debian-reference-en developers-reference postgresql-doc-15 python3.11-doc perl-doc
  manpages manpages-dev git-doc nodejs-doc python-django-doc octave-doc libreoffice-help-en-us
  lilypond-doc-html linux-doc-6.1 dict-gcide wordnet-base erlang-doc racket-doc python-pandas-doc
  python-scipy-doc python-statsmodels-doc sagemath-doc ghc-doc openjdk-17-doc rust-doc libboost1.81-doc cmake-doc
  llvm-15-doc clang-15-doc python-sqlalchemy-doc sphinx-doc python-astropy-doc python-sklearn-doc fp-docs-3.2.2
  postfix-doc exim4-doc-html bind9-doc zsh-doc bash-doc python-sympy-doc python-scrapy-doc python-werkzeug-doc
  python-flask-doc python-requests-doc python-setuptools-doc maxima-doc gimp-help-en)
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
  lic=$(find "$CACHE/root/$p/usr/share/doc" -name copyright -exec grep -h '^License:' {} + 2>/dev/null \
    | sed 's/^License: *//' | sort -u | paste -sd ';' -)
  printf '%s\t%s\t%s\n' "$p" "$(dpkg-deb -f "$deb" Version)" "${lic:-see /usr/share/doc/$p/copyright}" >>"$OUT/packages.tsv"
done

echo "== 2. clean text"
python3 scripts/corpus/clean.py --root "$CACHE/root" --out "$OUT" --packages "${PACKAGES[@]}"

echo "== 3. tokenizer and shards"
"$NIBBLE" data tokenizer --vocab "$VOCAB" --sample-lines "$SAMPLE_LINES" --seed "$SEED" --out "$OUT/tokenizer.model" \
  "$OUT/train.txt"
"$NIBBLE" data shards --tokenizer "$OUT/tokenizer.model" --out "$OUT/train.bin" "$OUT/train.txt"
"$NIBBLE" data shards --tokenizer "$OUT/tokenizer.model" --out "$OUT/val.bin" "$OUT/val.txt"
ls -l "$OUT"
