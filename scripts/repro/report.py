#!/usr/bin/env python3
# Regenerates every table and figure of docs/results/tetrajet-v2-small.md (issue #14) from the
# committed metrics files (docs/results/data/ARM.metrics.jsonl, one per arm and seed, as
# scripts/repro/device.sh returns them): the generated part of the report (between the
# `<!-- generated:begin -->` / `<!-- generated:end -->` markers) is rewritten, the PNGs are drawn
# by `nibble plot` (train/plot.h). Nothing is invented: runs that are missing or unfinished are
# listed as such. Stdlib only.
#   scripts/repro/report.py [--data DIR] [--report FILE] [--figures DIR] [--nibble BIN]
import argparse
import glob
import json
import math
import os
import re
import statistics
import subprocess
import sys

ARMS = ['bf16', 'nvfp4-nvidia', 'tj-base', 'tj-outcontrol', 'tj-oscireset', 'tj-full']
BEGIN, END = '<!-- generated:begin -->', '<!-- generated:end -->'


def read_run(path, total_steps):
    events = []
    with open(path, encoding='utf-8') as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:  # a partial last line
                    pass
    name = os.path.basename(path)[:-len('.metrics.jsonl')]
    m = re.fullmatch(r'(.+)-s(\d+)', name)
    arm, seed = (m.group(1), int(m.group(2))) if m else (name, 0)
    steps = [e for e in events if 'loss' in e and 'step' in e and 'event' not in e]
    vals = [e for e in events if 'val_loss' in e and e.get('event') != 'end']
    start = next((e for e in events if e.get('event') == 'start'), {})
    end = next((e for e in reversed(events) if e.get('event') == 'end'), None)
    total = total_steps
    tps = [e['tokens_per_s'] for e in steps if isinstance(e.get('tokens_per_s'), (int, float))]
    last_val = vals[-1] if vals else {}
    recipe = {k: v for k, v in last_val.items() if k.startswith('recipe.')}
    return dict(name=name, arm=arm, seed=seed, complete=end is not None and end.get('step') == total, steps_done=steps[-1]['step'] if steps else 0,
                total_steps=total, val_loss=last_val.get('val_loss'), val_ppl=last_val.get('val_ppl'),
                val_step=last_val.get('step'),
                wall_s=training_seconds(events),
                tokens_per_s=statistics.median(tps) if tps else None, recipe=recipe, path=path, vals=vals)


def training_seconds(events):
    """Seconds of training over every segment of a resumed run: each segment's elapsed_s counts from
    its own start (or resume) event, so sum the last elapsed_s of each segment, the final one's end
    event if it has one. Steps a killed segment ran past its last checkpoint were cut from the file
    on resume and are not counted (they were repeated)."""
    total, last = 0.0, None
    for e in events:
        if e.get('event') in ('start', 'resume'):
            total += last or 0.0
            last = None
        elif e.get('event') == 'end' and isinstance(e.get('seconds'), (int, float)):
            last = float(e['seconds'])
        elif isinstance(e.get('elapsed_s'), (int, float)):
            last = float(e['elapsed_s'])
    return total + last if last is not None else (total or None)


def fmt(x, digits=3):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return '-'
    return f'{x:.{digits}f}' if isinstance(x, float) else str(x)


def gap_fraction(ppl_arm, ppl_nvidia, ppl_bf16):
    if None in (ppl_arm, ppl_nvidia, ppl_bf16) or ppl_nvidia == ppl_bf16:
        return None
    return (ppl_nvidia - ppl_arm) / (ppl_nvidia - ppl_bf16)


def block_linear_weights(model_config):
    """Weights of the block linears (q, k, v, o, gate, up, down per layer) of an OLMo-2 config."""
    c = json.load(open(model_config, encoding='utf-8'))
    h, i, layers = c['hidden_size'], c['intermediate_size'], c['num_hidden_layers']
    kv = h // c['num_attention_heads'] * c.get('num_key_value_heads', c['num_attention_heads'])
    return layers * (2 * h * h + 2 * kv * h + 3 * h * i)


def tables(runs, linear_weights=None):
    out = []
    out.append('### Runs\n')
    out.append('| run | arm | seed | status | steps | final val loss | final val ppl | wall time (s) | tokens/s (median) |')
    out.append('|---|---|---|---|---|---|---|---|---|')
    for r in runs:
        status = 'complete' if r['complete'] else 'unfinished'
        out.append(f"| {r['name']} | {r['arm']} | {r['seed']} | {status} | {r['steps_done']}/{r['total_steps'] or '?'} | "
                   f"{fmt(r['val_loss'], 4)} | {fmt(r['val_ppl'], 3)} | {fmt(r['wall_s'], 0)} | "
                   f"{fmt(r['tokens_per_s'], 0)} |")
    done = [r for r in runs if r['complete'] and r['val_ppl'] is not None]
    by_arm = {}
    for r in done:
        by_arm.setdefault(r['arm'], []).append(r)
    mean = {a: statistics.mean(x['val_ppl'] for x in rs) for a, rs in by_arm.items()}
    by_seed = {a: {x['seed']: x['val_ppl'] for x in rs} for a, rs in by_arm.items()}
    out.append('\n### Per arm: validation perplexity and the share of the nvfp4-nvidia -> bf16 gap closed\n')
    out.append('gap closed = (ppl_nvidia - ppl_arm) / (ppl_nvidia - ppl_bf16). A seed fixes the '
               'initialization and the data order, so arms are compared on the same seeds: "same seeds" '
               'uses the means over the seeds this arm ran of bf16, nvfp4-nvidia and the arm; "per seed" '
               'each run against the baselines of its own seed. Spread = max - min over seeds.\n')
    out.append('| arm | seeds | mean val ppl | spread | gap closed (same seeds) | gap closed per seed |')
    out.append('|---|---|---|---|---|---|')
    for arm in ARMS + sorted(set(by_arm) - set(ARMS)):
        rs = by_arm.get(arm)
        if not rs:
            out.append(f'| {arm} | 0 | not run | - | - | - |')
            continue
        ppls = [x['val_ppl'] for x in rs]
        spread = max(ppls) - min(ppls) if len(ppls) > 1 else None
        seeds = [x['seed'] for x in rs]
        base = {b: [by_seed[b][sd] for sd in seeds if sd in by_seed.get(b, {})] for b in ('nvfp4-nvidia', 'bf16')}
        g = None
        if all(len(v) == len(seeds) for v in base.values()):
            g = gap_fraction(mean[arm], statistics.mean(base['nvfp4-nvidia']), statistics.mean(base['bf16']))
        per = ', '.join(fmt(gap_fraction(x['val_ppl'], by_seed.get('nvfp4-nvidia', {}).get(x['seed']),
                                         by_seed.get('bf16', {}).get(x['seed']))) for x in rs)
        out.append(f"| {arm} | {', '.join(str(x['seed']) for x in rs)} | {fmt(mean[arm])} | {fmt(spread)} | "
                   f"{fmt(g)} | {per} |")
    out.append('\n### OsciReset and OutControl state at the last validation\n')
    out.append('oscillating fraction = resets at the last decision / the weights OsciReset watches (summed over '
               'linears: `recipe.oscireset.eligible`, the FP4 elements without the outlier channels; where a run '
               'predates that counter, all block-linear weights of the model config, marked *).\n')
    out.append('| run | resets (total) | resets (last) | watched weights | oscillating fraction | start step | '
               'outlier channels | selected linears |')
    out.append('|---|---|---|---|---|---|---|---|')
    for r in runs:
        k = r['recipe']
        if not k:
            continue
        watched, last = k.get('recipe.oscireset.eligible'), k.get('recipe.oscireset.resets_last')
        mark = ''
        if not watched and linear_weights and last is not None:  # only runs with OsciReset on
            watched, mark = float(linear_weights), '*'
        frac = last / watched if watched and last is not None else None
        out.append(f"| {r['name']} | {fmt(k.get('recipe.oscireset.resets_total'), 0)} | {fmt(last, 0)} | "
                   f"{fmt(watched, 0)}{mark} | {fmt(frac, 5)}{mark} | {fmt(k.get('recipe.oscireset.start_step'), 0)} | "
                   f"{fmt(k.get('recipe.outliers.channels'), 0)} | {fmt(k.get('recipe.outliers.selected'), 0)} |")
    return '\n'.join(out) + '\n'


def plots(runs, figures, nibble, rel):
    os.makedirs(figures, exist_ok=True)
    paths = [r['path'] for r in runs][:10]
    lines = []
    steps = max((r['total_steps'] or r['steps_done'] or 0) for r in runs) if runs else 0

    def plot(name, key, title, extra=(), only=None):
        files = only if only is not None else paths
        if not files:
            return
        out = os.path.join(figures, name)
        cmd = [nibble, 'plot', '--key', key, '--title', title, '--out', out, *extra, *files]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            lines.append(f'- {name}: not drawn ({res.stderr.strip()})')
            return
        lines.append(f'![{title}]({os.path.join(rel, name)})')

    plot('val_loss.png', 'val_loss', 'validation loss, all runs')
    plot('val_loss_late.png', 'val_loss', 'validation loss, last 35 percent',
         extra=('--from-step', str(int(0.65 * steps))))
    plot('train_loss.png', 'loss', 'training loss, all runs')
    osc = [r['path'] for r in runs if 'recipe.oscireset.resets_total' in r['recipe']]
    plot('oscireset_resets.png', 'recipe.oscireset.resets_total', 'oscireset resets, total', only=osc)
    plot('oscireset_resets_last.png', 'recipe.oscireset.resets_last',
         'oscireset resets at the latest decision (weights moved onto their grid point)', only=osc,
         extra=('--from-step', str(int(0.6 * steps))))
    return '\n\n'.join(lines) + '\n'


def main(argv=None):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap = argparse.ArgumentParser()
    ap.add_argument('--data', default=os.path.join(root, 'docs/results/data'))
    ap.add_argument('--report', default=os.path.join(root, 'docs/results/tetrajet-v2-small.md'))
    ap.add_argument('--figures', default=None, help='default: DATA/../figures')
    ap.add_argument('--nibble', default=os.path.join(root, 'build/cpu/bin/nibble'))
    ap.add_argument('--steps', type=int, default=None, help='steps of every run (default: scripts/repro/base.json)')
    args = ap.parse_args(argv)
    figures = args.figures or os.path.join(os.path.dirname(os.path.abspath(args.data)), 'figures')
    steps = args.steps or json.load(open(os.path.join(root, 'scripts/repro/base.json')))['steps']
    runs = [read_run(p, steps) for p in sorted(glob.glob(os.path.join(args.data, '*.metrics.jsonl')))]
    if not os.path.exists(args.report):
        print(f'report.py: {args.report} missing', file=sys.stderr)
        return 1
    text = open(args.report, encoding='utf-8').read()
    if BEGIN not in text or END not in text:
        print(f'report.py: {args.report} has no {BEGIN} ... {END} section', file=sys.stderr)
        return 1
    rel = os.path.relpath(figures, os.path.dirname(os.path.abspath(args.report)))
    body = f'\n_Generated by scripts/repro/report.py from {len(runs)} metrics file(s)._\n\n'
    base = json.load(open(os.path.join(root, 'scripts/repro/base.json')))
    body += tables(runs, block_linear_weights(os.path.join(root, base['model']))) + '\n### Figures\n\n' + (plots(runs, figures, args.nibble, rel) if runs else 'No runs yet.\n')
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    with open(args.report + '.tmp', 'w', encoding='utf-8') as f:
        f.write(text[:a] + body + text[b:])
    os.replace(args.report + '.tmp', args.report)
    print(f'report.py: {args.report}: {len(runs)} runs, {sum(r["complete"] for r in runs)} complete')
    return 0


if __name__ == '__main__':
    sys.exit(main())
