#!/usr/bin/python3
"""Decode through zipcached and measure what the compression costs attention.

A synthetic model (numpy only) of --layers layers prefills --prompt tokens
and then decodes --steps tokens. Every step, every layer sends its new K/V
through ZipCacheKVCache.update_and_fetch and runs grouped-query attention
for that step's query twice: over the K/V the daemon hands back (read
zero-copy from its shared mapping) and over the exact fp16 K/V the model
produced. The relative error between the two outputs is what the
compression costs; the daemon's byte accounting is what it saves. Both are
printed per layer and overall.

Synthetic data, shaped like real keys: per head a few channels with large
constant offsets (outlier channels) and a high-norm first token (the
attention sink); values and queries roughly normal.

    build/bin/zipcached --socket /tmp/z.sock &
    /usr/bin/python3 examples/attention_decode.py --socket /tmp/z.sock
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import zipcache
except ImportError:  # run from a checkout: use python/ next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
    import zipcache


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--socket", default=zipcache.default_socket_path(), help="zipcached's socket")
    p.add_argument("--layers", type=int, default=32, help="model layers (one cache each)")
    p.add_argument("--prompt", type=int, default=512, help="prefill tokens (one block per layer)")
    p.add_argument("--steps", type=int, default=256, help="decode steps (one token each)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer")
    p.add_argument("--q-heads", type=int, default=32, help="query heads (a multiple of --kv-heads)")
    p.add_argument("--head-dim", type=int, default=128, help="K and V head dim")
    p.add_argument("--policy", choices=["streaming", "per_call"], default="streaming",
                   help="daemon block policy (per_call is the seed's)")
    p.add_argument("--residual", type=int, default=0, help="streaming residual tokens (0: daemon default, 128)")
    p.add_argument("--hi-bits", type=int, default=4, help="bits of salient keys and of values")
    p.add_argument("--lo-bits", type=int, default=2, help="bits of the other keys")
    p.add_argument("--hi-fraction", type=float, default=0.20, help="fraction of salient key tokens")
    p.add_argument("--group-size", type=int, default=32, help="token rows per quantization group")
    p.add_argument("--eval-every", type=int, default=1, metavar="N",
                   help="compare attention every N-th decode step (the conversion to float32 "
                        "for numpy's attention dominates the run time)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    args = p.parse_args(argv)
    if args.q_heads % args.kv_heads:
        p.error("--q-heads must be a multiple of --kv-heads")
    if min(args.layers, args.prompt, args.kv_heads, args.head_dim, args.eval_every) < 1 or args.steps < 0:
        p.error("sizes must be positive")
    return args


class SyntheticLayer:
    """One layer's token stream: K with outlier channels and a sink, V and Q normal."""

    def __init__(self, rng: np.random.Generator, kv_heads: int, q_heads: int, head_dim: int) -> None:
        self.rng = rng
        self.shape = (1, kv_heads, head_dim)
        self.q_heads = q_heads
        # Outlier channels are a property of the head, fixed over tokens.
        self.offsets = np.zeros((kv_heads, head_dim), np.float32)
        for h in range(kv_heads):
            channels = rng.choice(head_dim, size=min(4, head_dim), replace=False)
            self.offsets[h, channels] = rng.uniform(8, 16, len(channels)) * rng.choice([-1, 1], len(channels))
        self.position = 0

    def kv(self, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        b, h, d = self.shape
        k = self.rng.standard_normal((b, h, tokens, d), dtype=np.float32) + self.offsets[None, :, None, :]
        if self.position == 0:
            k[:, :, 0, :] *= 6  # the attention sink
        v = self.rng.standard_normal((b, h, tokens, d), dtype=np.float32)
        self.position += tokens
        return k.astype(np.float16), v.astype(np.float16)

    def query(self) -> np.ndarray:
        b, _, d = self.shape
        return self.rng.standard_normal((b, self.q_heads, d), dtype=np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One query token per head, grouped-query: q [B, Hq, D], k/v [B, Hkv, T, D] -> [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d) / np.float32(np.sqrt(d))
    # einsum, not matmul: numpy's own loops beat a batched gemm of 4 rows.
    scores = np.einsum("bhgd,bhtd->bhgt", qg, k)  # [B, Hkv, G, T]
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights @ v).reshape(b, hq, d)


@dataclass
class LayerError:
    """Accumulated over decode steps: ||out - exact||^2 and ||exact||^2, and the worst step."""

    diff2: float = 0.0
    ref2: float = 0.0
    worst: float = 0.0
    steps: int = 0

    def add(self, out: np.ndarray, exact: np.ndarray) -> None:
        d2 = float(np.sum((out - exact) ** 2, dtype=np.float64))
        r2 = float(np.sum(exact ** 2, dtype=np.float64))
        self.diff2 += d2
        self.ref2 += r2
        self.worst = max(self.worst, np.sqrt(d2 / r2) if r2 else 0.0)
        self.steps += 1

    @property
    def relative(self) -> float:
        return float(np.sqrt(self.diff2 / self.ref2)) if self.ref2 else 0.0


def rel(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    codec = zipcache.CodecConfig(args.hi_bits, args.lo_bits, args.hi_fraction, args.group_size)
    total_tokens = args.prompt + args.steps
    layers = [SyntheticLayer(rng, args.kv_heads, args.q_heads, args.head_dim) for _ in range(args.layers)]
    shape = (1, args.kv_heads, total_tokens, args.head_dim)
    # The exact fp16 cache, kept as float32 (an exact widening) so the
    # reference attention needs no conversion per step.
    exact_k = [np.zeros(shape, np.float32) for _ in layers]
    exact_v = [np.zeros(shape, np.float32) for _ in layers]
    errors = [LayerError() for _ in layers]
    fetch_seconds = 0.0
    fetches = 0

    with zipcache.Client(args.socket) as client, client.open_session(
        layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, max_tokens=total_tokens,
        codec=codec, policy=args.policy, residual_tokens=args.residual,
    ) as session:
        caches = zipcache.make_prompt_cache(session)
        info = session.info
        print(f"zipcached {client.server_info.server_version} at {args.socket}: session {info.name!r}, "
              f"{args.layers} layers x [1, {args.kv_heads}, <= {total_tokens}, {args.head_dim}] fp16, "
              f"{args.q_heads} query heads")
        print(f"codec {codec.hi_bits}/{codec.lo_bits} bits, {codec.hi_fraction:.0%} salient, groups of "
              f"{codec.group_size}; policy {info.policy.name.lower()}"
              + (f", residual {info.residual_tokens}" if info.policy == zipcache.Policy.STREAMING else ""))
        print(f"prefill {args.prompt} tokens, then {args.steps} decode steps\n")

        for step in range(-1, args.steps):
            for i, (layer, cache) in enumerate(zip(layers, caches)):
                k, v = layer.kv(args.prompt if step < 0 else 1)
                start = cache.offset
                exact_k[i][:, :, start:start + k.shape[2]] = k
                exact_v[i][:, :, start:start + k.shape[2]] = v
                t0 = time.perf_counter()
                keys, values = cache.update_and_fetch(k, v)
                fetch_seconds += time.perf_counter() - t0
                fetches += 1
                if step < 0 or step % args.eval_every:
                    continue  # measure decode only
                n = keys.shape[2]
                q = layer.query()
                out = attention(q, keys.astype(np.float32), values.astype(np.float32))
                ref = attention(q, exact_k[i][:, :, :n], exact_v[i][:, :, :n])
                errors[i].add(out, ref)

        print(f"{'layer':>5}  {'attn rel err':>12}  {'worst step':>10}  {'K rel err':>9}  {'V rel err':>9}  "
              f"{'fp16 KiB':>9}  {'stored KiB':>10}  {'saved':>6}  {'K ratio':>7}  {'K bits':>6}")
        stats = session.stats()
        k_err = []
        v_err = []
        for i, (cache, layer_stats) in enumerate(zip(caches, stats.layers)):
            keys, values = cache.state
            n = keys.shape[2]
            k_err.append(rel(keys, exact_k[i][:, :, :n]))
            v_err.append(rel(values, exact_v[i][:, :, :n]))
            saved = 1 - layer_stats.compressed_bytes / layer_stats.fp16_bytes
            print(f"{i:>5}  {errors[i].relative:>12.4%}  {errors[i].worst:>10.4%}  {k_err[i]:>9.4%}  "
                  f"{v_err[i]:>9.4%}  {layer_stats.fp16_bytes / 1024:>9.1f}  "
                  f"{layer_stats.compressed_bytes / 1024:>10.1f}  {saved:>6.1%}  "
                  f"{layer_stats.compression_ratio:>7.2f}  {layer_stats.effective_avg_bits:>6.2f}")

        total = stats.total
        ref2 = sum(e.ref2 for e in errors)
        overall = np.sqrt(sum(e.diff2 for e in errors) / ref2) if ref2 else 0.0
        saved = 1 - total.compressed_bytes / total.fp16_bytes
        print(f"\noverall: attention rel err {overall:.4%} (worst layer {max(e.relative for e in errors):.4%}, "
              f"worst single step {max(e.worst for e in errors):.4%}) over {errors[0].steps} of "
              f"{args.steps} decode steps x {args.layers} layers")
        print(f"memory: fp16 {total.fp16_bytes / 2**20:.2f} MiB -> stored {total.compressed_bytes / 2**20:.2f} MiB "
              f"({saved:.1%} saved, {total.fp16_bytes / total.compressed_bytes:.2f}x K+V; keys "
              f"{total.compression_ratio:.2f}x, {total.effective_avg_bits:.2f} bits/element); "
              f"uniform {codec.lo_bits}-bit baseline {total.baseline_bytes / 2**20:.2f} MiB")
        print(f"update_and_fetch: {fetches} calls, {fetch_seconds / fetches * 1e6:.0f} us mean "
              f"(incl. the {args.layers} prefill blocks)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except zipcache.ZipCacheError as exc:
        print(f"attention_decode: {exc}", file=sys.stderr)
        sys.exit(1)
