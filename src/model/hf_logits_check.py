#!/usr/bin/env python3
# Cross-check of nibble's OLMo-2 / Qwen3-MoE forward against Hugging Face transformers: for each
# model folder written by hf_export_test.cpp (DISABLED_WriteModelsAndLogits), writes the weights as
# model.safetensors with their HF names, loads them with AutoModelForCausalLM.from_pretrained
# (f32, eager attention; no missing/unexpected keys allowed) and compares the logits of the same
# tokens. Usage: hf_logits_check.py <export root>. Needs torch, transformers, safetensors.
import json, os, sys
import numpy as np
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

root = sys.argv[1]
worst = 0.0
for name in sorted(os.listdir(root)):
    d = os.path.join(root, name)
    if not os.path.isfile(os.path.join(d, "index.json")):
        continue
    index = json.load(open(os.path.join(d, "index.json")))
    meta = json.load(open(os.path.join(d, "meta.json")))
    w = np.fromfile(os.path.join(d, "weights.bin"), dtype=np.float32)
    tensors = {e["name"]: torch.from_numpy(w[e["offset"]:e["offset"] + int(np.prod(e["shape"]))].reshape(e["shape"]).copy())
               for e in index}
    save_file(tensors, os.path.join(d, "model.safetensors"))
    model, info = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"{name}: loading problems {bad}"
    model.eval()
    B, T, V = meta["B"], meta["T"], meta["V"]
    tokens = torch.from_numpy(np.fromfile(os.path.join(d, "tokens.bin"), dtype=np.int32).reshape(B, T).astype(np.int64))
    ours = np.fromfile(os.path.join(d, "logits.bin"), dtype=np.float32).reshape(B, T, V)
    with torch.no_grad():
        theirs = model(input_ids=tokens).logits.float().numpy()
    diff = float(np.abs(theirs - ours).max())
    scale = float(np.abs(theirs).max())
    worst = max(worst, diff / scale)
    print(f"{name}: {type(model).__name__} max|logits| {scale:.3f} max|diff| {diff:.3e}")
print(f"worst relative difference {worst:.3e}")
# f32 forward of O(1)-scaled 2-3 layer models: differences ~1e-6 relative; wiring errors are O(1).
sys.exit(0 if worst < 1e-4 else 1)
