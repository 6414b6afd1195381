#!/usr/bin/python3
"""Saliency by key norm or by the attention tokens received: which loses less?

The seed ranks a block's tokens by key norm because a cache wrapper cannot
see attention; the ZipCache paper ranks them by normalized attention
scores. Under the streaming policy a worker that attends with zc_attend
does see them: a token waits in the exact residual for up to
--residual decode steps before its block is compressed, receiving
attention all along. This measures what ranking the flush by that
attention would buy, with the daemon's own codec (zipcache.codec, the
library's zc_block_compress and zc_block_compress_scored), at equal
stored bytes (the same config, so the same number of salient tokens).

One layer decodes --steps tokens after a --prompt token prefill, twice
over the same data:

  key_norm   every flushed block ranked by key norm (the contract, the
             daemon's behaviour);
  attention  every flushed block ranked by each token's normalized
             attention mass: the attention weights it received while in
             the residual, summed over the query heads of its KV head,
             divided by the number of decode queries that saw it;
  random     a control: salient tokens drawn at random, which says how
             much the choice matters at all on this data.

The prompt is compressed by key norm in both runs (it saw no decode
query), so the two differ only in the residual's flushes. Each step's
attention output (numpy float64 over the reconstructed blocks and the
exact residual) is compared with exact attention over the exact K/V.

Data: the synthetic K/V of examples/attention_decode.py (per head a few
outlier channels with large constant offsets, a high-norm first token,
values normal). Queries: independent normal draws as there
(--query-correlation 0), or a slowly drifting query per head
(q_t = c q_{t-1} + sqrt(1 - c^2) noise), closer to a real model where
the tokens attended to now are the tokens attended to next.

    /usr/bin/python3 examples/saliency_attention.py
    /usr/bin/python3 examples/saliency_attention.py --query-correlation 0.95 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

try:
    import zipcache
except ImportError:  # run from a checkout: use python/ next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
    import zipcache

from zipcache import codec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_decode import SyntheticLayer  # noqa: E402  (the same synthetic data)

RANKINGS = ("key_norm", "attention", "random")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompt", type=int, default=512, help="prefill tokens (one block)")
    p.add_argument("--steps", type=int, default=1024, help="decode steps (one token each)")
    p.add_argument("--residual", type=int, default=128, help="streaming residual tokens")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hi-bits", type=int, default=4)
    p.add_argument("--lo-bits", type=int, default=2)
    p.add_argument("--hi-fraction", type=float, default=0.20)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--query-correlation", type=float, default=0.0,
                   help="c in q_t = c q_(t-1) + sqrt(1-c^2) noise; 0: independent queries")
    p.add_argument("--exact-values", action="store_true",
                   help="keep values exact (quantize_values off): the error is then the keys' alone")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object per ranking, then a summary")
    args = p.parse_args(argv)
    if args.q_heads % args.kv_heads:
        p.error("--q-heads must be a multiple of --kv-heads")
    if not 0.0 <= args.query_correlation < 1.0:
        p.error("--query-correlation must be in [0, 1)")
    if min(args.prompt, args.residual, args.kv_heads, args.head_dim) < 1 or args.steps < 0:
        p.error("sizes must be positive")
    return args


def weights_and_output(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention of one query token per head (GQA): q [Hq, D], k/v [Hkv, T, D] ->
    (weights [Hkv, G, T], output [Hq, D])."""
    hq, d = q.shape
    hkv = k.shape[0]
    qg = q.reshape(hkv, hq // hkv, d) / np.sqrt(d)
    scores = np.einsum("hgd,htd->hgt", qg, k)
    scores -= scores.max(axis=-1, keepdims=True)
    w = np.exp(scores)
    w /= w.sum(axis=-1, keepdims=True)
    return w, np.einsum("hgt,htd->hgd", w, v).reshape(hq, d)


def run(args: argparse.Namespace, ranking: str) -> dict:
    config = zipcache.CodecConfig(hi_bits=args.hi_bits, lo_bits=args.lo_bits,
                                  hi_fraction=args.hi_fraction, group_size=args.group_size,
                                  quantize_values=not args.exact_values)
    rng = np.random.default_rng(args.seed)  # the same draws for every ranking
    chooser = np.random.default_rng(args.seed + 1)  # the random ranking's own draws
    layer = SyntheticLayer(rng, args.kv_heads, args.q_heads, args.head_dim)
    hkv, d = args.kv_heads, args.head_dim

    exact_k, exact_v = layer.kv(args.prompt)
    blocks_k = [codec.roundtrip(exact_k, "keys", config)[0].astype(np.float64)]
    blocks_v = [codec.roundtrip(exact_v, "values", config)[0].astype(np.float64)]
    stored = len(codec.compress(exact_k, "keys", config)) + len(codec.compress(exact_v, "values", config))
    exact_k = exact_k[0].astype(np.float64)
    exact_v = exact_v[0].astype(np.float64)

    res_k: list[np.ndarray] = []  # exact fp16 rows [Hkv, D] waiting in the residual
    res_v: list[np.ndarray] = []
    mass = np.zeros((hkv, 0))
    seen = np.zeros(0)
    q = rng.standard_normal((args.q_heads, d))
    c = args.query_correlation
    diff2 = ref2 = 0.0
    diff2_after = ref2_after = 0.0
    flushes = 0
    for step in range(args.steps):
        k_new, v_new = layer.kv(1)
        res_k.append(k_new[0, :, 0, :])
        res_v.append(v_new[0, :, 0, :])
        mass = np.concatenate([mass, np.zeros((hkv, 1))], axis=1)
        seen = np.concatenate([seen, [0.0]])
        exact_k = np.concatenate([exact_k, k_new[0].astype(np.float64)], axis=1)
        exact_v = np.concatenate([exact_v, v_new[0].astype(np.float64)], axis=1)

        q = c * q + np.sqrt(1.0 - c * c) * rng.standard_normal((args.q_heads, d))
        kk = np.concatenate(blocks_k + [np.stack(res_k, axis=1).astype(np.float64)], axis=1)
        vv = np.concatenate(blocks_v + [np.stack(res_v, axis=1).astype(np.float64)], axis=1)
        w, out = weights_and_output(q, kk, vv)
        _, ref = weights_and_output(q, exact_k, exact_v)
        d2 = float(np.sum((out - ref) ** 2))
        r2 = float(np.sum(ref ** 2))
        diff2 += d2
        ref2 += r2
        if flushes:
            diff2_after += d2
            ref2_after += r2
        # What the residual's tokens received from this query, per KV head.
        n_res = len(res_k)
        mass += w[:, :, -n_res:].sum(axis=1)
        seen += 1.0

        if n_res == args.residual:
            block_k = np.stack(res_k, axis=1)[None].astype(np.float16)
            block_v = np.stack(res_v, axis=1)[None].astype(np.float16)
            scores = None
            if ranking == "attention":
                scores = (mass / seen)[None].astype(np.float32)
            elif ranking == "random":
                scores = chooser.random((1, hkv, n_res)).astype(np.float32)
            payload = codec.compress(block_k, "keys", config, scores=scores)
            blocks_k.append(codec.reconstruct(payload, block_k.shape, "keys", config)[0].astype(np.float64))
            blocks_v.append(codec.roundtrip(block_v, "values", config)[0].astype(np.float64))
            stored += len(payload) + len(codec.compress(block_v, "values", config))
            res_k, res_v = [], []
            mass = np.zeros((hkv, 0))
            seen = np.zeros(0)
            flushes += 1

    return {
        "ranking": ranking,
        "query_correlation": c,
        "steps": args.steps,
        "flushes": flushes,
        "stored_bytes": stored,
        "relative_error": float(np.sqrt(diff2 / ref2)) if ref2 else 0.0,
        "relative_error_after_first_flush": float(np.sqrt(diff2_after / ref2_after)) if ref2_after else 0.0,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    results = [run(args, ranking) for ranking in RANKINGS]
    base, att, control = results
    if len({r["stored_bytes"] for r in results}) != 1:
        raise SystemExit("stored bytes differ: the comparison is not at equal bytes")

    def over_base(r: dict) -> float:
        b = base["relative_error_after_first_flush"]
        return r["relative_error_after_first_flush"] / b if b else float("nan")

    ratio = over_base(att)
    summary = {"summary": True, "query_correlation": args.query_correlation,
               "exact_values": args.exact_values,
               "attention_over_key_norm_error": ratio,
               "random_over_key_norm_error": over_base(control),
               "stored_bytes": base["stored_bytes"]}
    if args.json:
        for r in results + [summary]:
            print(json.dumps(r))
    else:
        print(f"prompt {args.prompt}, {args.steps} decode steps, residual {args.residual}, "
              f"query correlation {args.query_correlation}, {base['stored_bytes']} bytes stored by both")
        print(f"{'ranking':<10} {'error (all steps)':>18} {'error (after 1st flush)':>24}")
        for r in results:
            print(f"{r['ranking']:<10} {r['relative_error']:>18.5f} {r['relative_error_after_first_flush']:>24.5f}")
        print(f"after the first flush, error over key_norm's: attention {ratio:.4f}, "
              f"random {over_base(control):.4f}")
    return results + [summary]


if __name__ == "__main__":
    main()
