#!/usr/bin/env python3
# What a Hugging Face user's generation costs on the same GPU (issue #15 §4): `transformers`
# generate on the model config nibble's `bench decode` runs (random weights, BF16, SDPA attention),
# for the same batches, prompt length and new tokens, greedy with every sequence running all new
# tokens (no EOS). Decode tokens/s = batch * (new - 1) / (time of generating `new` tokens - time
# of generating 1), the same subtraction `nibble bench decode` makes. One JSON line per batch.
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True, help="HF config.json (e.g. configs/olmo2-1b.json)")
    ap.add_argument("--batch", default="1,16,64,256", help="comma list of batch sizes")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.new < 2 or a.prompt < 1:
        print("--new must be >= 2 and --prompt >= 1", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(a.config)
    cfg.torch_dtype = torch.bfloat16
    torch.manual_seed(a.seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    gen = torch.Generator(device="cuda").manual_seed(a.seed)

    def run(ids, new):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + new
        return time.perf_counter() - t0

    for b in [int(x) for x in a.batch.split(",")]:
        ids = torch.randint(0, cfg.vocab_size, (b, a.prompt), device="cuda", generator=gen)
        try:
            run(ids, 2)  # warm-up
            prefill = run(ids, 1)
            total = run(ids, a.new)
        except torch.cuda.OutOfMemoryError as e:
            print(json.dumps({"bench": "hf_generate", "config": a.config, "batch": b, "error": str(e).splitlines()[0]}))
            torch.cuda.empty_cache()
            continue
        decode = max(total - prefill, 1e-9)
        print(json.dumps({"bench": "hf_generate", "config": a.config, "batch": b, "prompt": a.prompt,
                          "new_tokens": a.new, "prefill_s": prefill, "decode_s": decode,
                          "decode_tokens_per_s": b * (a.new - 1) / decode,
                          "transformers": __import__("transformers").__version__, "torch": torch.__version__}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
