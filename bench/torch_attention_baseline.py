#!/usr/bin/env python3
# What a PyTorch user's attention costs on the same GPU (issue #13): causal GQA
# torch.nn.functional.scaled_dot_product_attention in BF16 (the flash or cuDNN kernel PyTorch picks),
# forward and forward+backward, at the training shapes nibble benches. Prints one JSON line per
# shape: median ms over timed repeats (CUDA events) and TFLOP/s with causal FLOPs (forward
# 2*B*H*T^2*D, backward 2.5x the forward), the same count nibble's attention bench prints.
import argparse
import json
import sys


def bench_shape(B, T, H, Hkv, D, repeats, warmup):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    dout = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    gqa = H != Hkv

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def time_it(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        times.sort()
        return times[len(times) // 2]

    with torch.no_grad():
        fwd_ms = time_it(fwd)
    out = fwd()

    def bwd():
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    bwd_ms = time_it(bwd)
    flops_fwd = 2.0 * B * H * T * T * D  # causal: half of 4*B*H*T^2*D
    return {
        "shape": f"B={B} T={T} H={H} Hkv={Hkv} D={D}",
        "torch": torch.__version__,
        "forward_ms": round(fwd_ms, 4),
        "backward_ms": round(bwd_ms, 4),
        "forward_tflops": round(flops_fwd / fwd_ms / 1e9, 1),
        "backward_tflops": round(2.5 * flops_fwd / bwd_ms / 1e9, 1),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="16x4096x8x8x64,8x4096x16x16x64,8x4096x12x4x64",
                    help="comma list of BxTxHxHkvxD")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("torch_attention_baseline: PyTorch is not installed", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("torch_attention_baseline: no CUDA device", file=sys.stderr)
        return 1
    for s in a.shapes.split(","):
        try:
            B, T, H, Hkv, D = (int(x) for x in s.split("x"))
        except ValueError:
            print(f"torch_attention_baseline: bad shape '{s}' (want BxTxHxHkvxD)", file=sys.stderr)
            return 2
        print(json.dumps(bench_shape(B, T, H, Hkv, D, a.repeats, a.warmup)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
