#!/usr/bin/env bash
# ctest dp_scaling_script: scripts/dp_scaling.sh on the tiny OLMo-2 (configs/pretrain-tiny.json) at
# world sizes 1 and 2 under mpirun, 4 steps of 2 x 32 tokens per rank on README.md: one JSON line
# per world with positive tokens/s, efficiency exactly 1 at world 1 and finite at world 2; bad
# arguments exit 2. Exit 77 (ctest: skipped) without mpirun. Usage: test_dp_scaling.sh NIBBLE_BINARY
set -euo pipefail
NIBBLE=$1
command -v mpirun >/dev/null || { echo "mpirun not found: skipped"; exit 77; }
# Under the ASan build LeakSanitizer reports OpenMPI's own allocations at exit: off for the mpirun
# launches, as the C++ MPI tests do (src/dist/mpi_test_util.h); ASan's other checks stay on.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$here/dp_scaling.sh" --nibble "$NIBBLE" --steps 4 --warmup 1 --micro-batch 2 --seq 32 --worlds "1 2" \
  --data "$here/../README.md" --out "$tmp/run" >"$tmp/out.jsonl" 2>"$tmp/err.txt" || { cat "$tmp/err.txt"; exit 1; }
python3 - "$tmp/out.jsonl" <<'PY'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
assert [r["world"] for r in rows] == [1, 2], rows
for r in rows:
    assert r["bench"] == "dp_scaling" and r["micro_batch"] == 2 and r["seq"] == 32 and r["timed_steps"] == 3, r
    assert r["tokens_per_s"] > 0 and math.isfinite(r["tokens_per_s"]), r
    assert abs(r["tokens_per_s_per_rank"] * r["world"] - r["tokens_per_s"]) <= 1e-9 * r["tokens_per_s"], r
assert rows[0]["efficiency"] == 1.0, rows[0]
assert 0 < rows[1]["efficiency"] < 10 and math.isfinite(rows[1]["efficiency"]), rows[1]
assert abs(rows[1]["efficiency"] - rows[1]["tokens_per_s"] / (2 * rows[0]["tokens_per_s"])) < 1e-12, rows[1]
print("dp_scaling.sh:", " ".join(f"world {r['world']} {r['tokens_per_s']:.0f} tok/s" for r in rows))
PY
grep -q "efficiency" "$tmp/err.txt" || { echo "no table on stderr"; cat "$tmp/err.txt"; exit 1; }
for bad in "--steps x" "--steps 4 --warmup 4" "--frobnicate 1" "--worlds" "--launcher slurm"; do
  rc=0
  # shellcheck disable=SC2086
  "$here/dp_scaling.sh" --nibble "$NIBBLE" $bad >/dev/null 2>&1 || rc=$?
  [ "$rc" = 2 ] || { echo "dp_scaling.sh $bad: exit $rc, expected 2"; exit 1; }
done
echo "dp_scaling.sh: bad arguments exit 2"
