"""generate() with transformers' DynamicCache and with zipcache's SessionCache, compared.

A small Llama-style model built from a config object (random weights from a
fixed seed, nothing downloaded); the same prompt through both caches,
greedy. Returns the largest relative logit difference per step
(max |a - b| / max |b|) and whether the generated tokens agree.
"""

from __future__ import annotations

import json
import os

import torch

import zipcache
import zipcache.torch as zt

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 32
PROMPT, NEW = 40, 8


def tiny_llama(device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=HEADS * HEAD_DIM, intermediate_size=256,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    return model


def compare_generate(open_session, device, dtype, hi_bits, lo_bits, views="full"):
    import transformers
    from transformers import DynamicCache

    model = tiny_llama(device, dtype)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (1, PROMPT), generator=generator).to(device)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, attention_mask=torch.ones_like(ids),
                  eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        reference = model.generate(ids, past_key_values=DynamicCache(), **kwargs)
        # per_call: the prompt is one compressed block, so the codec is in the loop.
        session = open_session(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                               max_tokens=PROMPT + NEW + 8, policy="per_call",
                               codec=zipcache.CodecConfig(hi_bits=hi_bits, lo_bits=lo_bits),
                               views=views)
        cache = zt.SessionCache(session, device=device)
        ours = model.generate(ids, past_key_values=cache, **kwargs)
    rel = []
    for a, b in zip(ours.logits, reference.logits):
        rel.append(float((a.float() - b.float()).abs().max() / b.float().abs().max()))
    report = {
        "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "hi_bits": hi_bits, "lo_bits": lo_bits, "views": views, "transformers": transformers.__version__,
        "torch": torch.__version__, "steps": len(rel), "max_rel": max(rel),
        "rel_per_step": [round(x, 6) for x in rel],
        "same_tokens": bool(torch.equal(ours.sequences, reference.sequences)),
        "cached_tokens": cache.get_seq_length(),
    }
    path = os.environ.get("ZC_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(report) + "\n")
    print(json.dumps(report))
    return report
