#!/usr/bin/env python3
# The benchmark table at the end of scripts/gpu_check.sh: one row per `nibble bench train` log
# ($OUT/bench_train_<config>_<recipe>.log) and per PyTorch baseline line ($OUT/torch_baseline.jsonl),
# tokens/s, MFU and peak memory where the output says them, and nibble bf16 / PyTorch ratios.
# nibble's rows are read from a JSON line when the CLI prints one, else from "key value" / "key: value"
# text (tokens/s, mfu, peak); a row it cannot read shows the log's last line.
import glob
import json
import os
import re
import sys

NUM = r"([0-9][0-9.,]*(?:e[+-]?[0-9]+)?)\s*([kKMG]?)"


def number(text, scale=""):
    v = float(text.replace(",", ""))
    return v * {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9}[scale]


def parse_nibble(path):
    lines = [l.strip() for l in open(path, errors="replace") if l.strip()]
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                j = json.loads(line)
            except ValueError:
                continue
            tok = j.get("tokens_per_second", j.get("tokens_per_s"))
            peak = j.get("peak_gib", j.get("peak_mem_gib"))
            if peak is None and j.get("peak_bytes", -1) not in (None, -1):
                peak = j["peak_bytes"] / 2**30
            return {"tok_s": tok, "mfu": j.get("mfu"), "peak_gib": peak, "note": ""}
    text = "\n".join(lines)
    row = {"tok_s": None, "mfu": None, "peak_gib": None, "note": ""}
    m = re.search(r"tok(?:ens)?/s[:=]?\s*" + NUM, text) or re.search(NUM + r"\s*tok(?:ens)?/s", text)
    if m:
        row["tok_s"] = number(m.group(1), m.group(2))
    m = re.search(r"mfu[:=]?\s*([0-9.]+)\s*(%?)", text, re.I)
    if m:
        row["mfu"] = float(m.group(1)) / (100 if m.group(2) else 1)
    m = re.search(r"peak[^0-9\n]*([0-9.]+)\s*GiB", text, re.I)
    if m:
        row["peak_gib"] = float(m.group(1))
    if row["tok_s"] is None:
        row["note"] = lines[-1][:80] if lines else "empty log"
    return row


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def main(out):
    rows = []
    nibble_bf16 = {}
    for path in sorted(glob.glob(os.path.join(out, "bench_train_*.log"))):
        name = os.path.basename(path)[len("bench_train_"):-len(".log")]
        if name == "linear":
            continue
        config, _, recipe = name.rpartition("_")
        r = parse_nibble(path)
        rows.append(("nibble", config, recipe, r))
        if recipe == "bf16" and r["tok_s"]:
            nibble_bf16[config] = r["tok_s"]
    torch_tok = {}
    tpath = os.path.join(out, "torch_baseline.jsonl")
    if os.path.exists(tpath):
        for line in open(tpath):
            try:
                j = json.loads(line)
            except ValueError:
                continue
            config = os.path.basename(j["config"])[: -len(".json")]
            torch_tok[config] = j["tokens_per_s"]
            rows.append(("pytorch", config, "bf16-autocast",
                         {"tok_s": j["tokens_per_s"], "mfu": j["mfu"], "peak_gib": j["peak_mem_gib"], "note": ""}))
    if not rows:
        print("(no training benchmark rows)")
    else:
        print(f"{'engine':8} {'config':14} {'recipe':14} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>8}  note")
        for engine, config, recipe, r in rows:
            note = r["note"]
            if engine == "nibble" and r["tok_s"]:
                parts = []
                if config in torch_tok:
                    parts.append(f"{r['tok_s'] / torch_tok[config]:.2f}x pytorch")
                if recipe != "bf16" and config in nibble_bf16:
                    parts.append(f"{r['tok_s'] / nibble_bf16[config]:.2f}x own bf16")
                note = ", ".join(parts)
            print(f"{engine:8} {config:14} {recipe:14} {fmt(r['tok_s'], '10.0f'):>10} {fmt(r['mfu'], '6.3f'):>6} "
                  f"{fmt(r['peak_gib'], '8.2f'):>8}  {note}")
    lpath = os.path.join(out, "bench_train_linear.log")
    if os.path.exists(lpath):
        print("linear bench (last lines):")
        for line in [l.rstrip() for l in open(lpath, errors="replace") if l.strip()][-6:]:
            print("  " + line)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_out")
