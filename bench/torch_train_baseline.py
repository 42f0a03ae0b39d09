#!/usr/bin/env python3
# What a PyTorch user runs today for a training step (issue #13, 05-performance-anchors.md): a
# Hugging Face `transformers` model built from one of nibble's config.json files (random init),
# torch.compile, SDPA attention, fused AdamW, BF16 autocast over FP32 master weights. Prints one
# JSON line per config: tokens/s, model FLOPs utilisation and peak memory, measured over timed
# steps after warm-up, so `nibble bench train` can be compared in the same call on the same GPU.
# MFU: model FLOPs/token = 6 * (non-embedding active params, lm_head included) + 6 * layers *
# width * seq (causal attention), against --peak-tflops (default: the measured H200 BF16 GEMM
# rate, 756); this reproduces the anchors' MFU (28.7% / 39.0% / 6.8%).
import argparse
import json
import sys
import time


def active_non_embedding_params(model, cfg):
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:  # a lookup; the lm_head is a GEMM and counts
            continue
        n = p.numel()
        if ".mlp.experts." in name and getattr(cfg, "num_experts", 0):
            n = n * cfg.num_experts_per_tok / cfg.num_experts  # only top-k experts are active per token
        total += n
    return total


def run(config_path, batch, seq, steps, warmup, peak_tflops, compile_model):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_path)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, seq)
    if hasattr(cfg, "output_router_logits"):
        cfg.output_router_logits = True  # the aux loss is part of the MoE training step
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", torch_dtype=torch.float32).cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    step_fn_model = torch.compile(model) if compile_model else model
    V = cfg.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, V, (batch, seq + 1), device="cuda", generator=gen)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = step_fn_model(input_ids=x, labels=y)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tok_s = batch * seq * steps / dt
    n_act = active_non_embedding_params(model, cfg)
    flops_per_token = 6 * n_act + 6 * cfg.num_hidden_layers * cfg.hidden_size * seq
    return {
        "config": config_path, "batch": batch, "seq": seq, "steps": steps,
        "tokens_per_s": round(tok_s), "mfu": round(tok_s * flops_per_token / (peak_tflops * 1e12), 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "step_ms": round(1000 * dt / steps, 2), "loss": float(loss),
        "torch": torch.__version__, "device": torch.cuda.get_device_name(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", action="append", required=True, help="config.json (repeatable)")
    ap.add_argument("--batch", type=int, action="append", help="batch per config (repeatable, default 8)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=756.0)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    batches = a.batch or [8] * len(a.config)
    if len(batches) != len(a.config):
        sys.exit("torch_train_baseline: give one --batch per --config")
    for cfg, b in zip(a.config, batches):
        print(json.dumps(run(cfg, b, a.seq, a.steps, a.warmup, a.peak_tflops, not a.no_compile)), flush=True)


if __name__ == "__main__":
    main()
