#!/usr/bin/python3
"""Decode through zipcached, attend from the compressed cache, and measure what it costs.

A synthetic model (numpy only) of --layers layers prefills --prompt tokens
and then decodes --steps tokens, twice over the same data:

  compressed  a views="none" session (the daemon keeps only compressed
              blocks and the exact residual, no fp16 views); every step,
              every layer attends with zipcache.attend (zc_attend: the
              layer's blocks and residual read in this process, the
              dequantization fused into the dot products);
  fp16 view   a views="full" session, the seed's way: update_and_fetch
              hands back the layer's fp16 view (zero-copy) and numpy runs
              the attention over it (widened to float32).

Both are compared with exact attention: numpy float64 over the exact fp16
K/V the example sent. Printed per layer and overall: the attention error,
the memory the daemon holds for the session (Client.memory_stats) over the
fp16 bytes of the tokens, and the time per decode step of each path.

Synthetic data, shaped like real keys: per head a few channels with large
constant offsets (outlier channels) and a high-norm first token (the
attention sink); values and queries roughly normal (--query-correlation C:
each head's query drifts, q_t = C q_(t-1) + sqrt(1 - C^2) noise).

--saliency attention opens the compressed path's session with
CodecConfig(saliency="attention"): every zipcache.attend call also returns
the residual's attention masses (mass=MassAccumulator), which ride on the
layer's next update, and the daemon's residual flushes rank the tokens by
them instead of by key norm. --saliency both runs the compressed path both
ways over the same data and prints the two errors at equal stored bytes
(docs/BENCHMARKS.md, "Saliency by attention through the daemon").

    build/bin/zipcached --socket /tmp/z.sock &
    /usr/bin/python3 examples/attention_decode.py --socket /tmp/z.sock
    /usr/bin/python3 examples/attention_decode.py --socket /tmp/z.sock --layers 32 --prompt 512 --steps 256
    /usr/bin/python3 examples/attention_decode.py --socket /tmp/z.sock --saliency both --steps 1024
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

try:
    import zipcache
except ImportError:  # run from a checkout: use python/ next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
    import zipcache

PATHS = ("compressed", "fp16 view")
# --saliency both: the compressed path again, its flushes ranked by attention.
BY_ATTENTION = "compressed, by attention"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--socket", default=zipcache.default_socket_path(), help="zipcached's socket")
    p.add_argument("--layers", type=int, default=4, help="model layers")
    p.add_argument("--prompt", type=int, default=512, help="prefill tokens (one block per layer)")
    p.add_argument("--steps", type=int, default=128,
                   help="decode steps (one token each; with the defaults the last one flushes the residual)")
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
    p.add_argument("--exact-values", action="store_true",
                   help="keep values exact fp16 (codec quantize_values off): the error is the keys' alone")
    p.add_argument("--threads", type=int, default=1, help="zipcache.attend's threads")
    p.add_argument("--eval-every", type=int, default=1, metavar="N",
                   help="attend and compare every N-th decode step")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    p.add_argument("--saliency", choices=["key_norm", "attention", "both"], default="key_norm",
                   help="how the compressed path's residual flushes rank tokens (both: run it both ways)")
    p.add_argument("--unnormalized", action="store_true",
                   help="with attention saliency, send each token's summed mass, not its mean over the steps")
    p.add_argument("--query-correlation", type=float, default=0.0, metavar="C",
                   help="each head's query drifts: q_t = C q_(t-1) + sqrt(1 - C^2) noise (0: independent)")
    p.add_argument("--json", action="store_true", help="also print one JSON line of the figures")
    p.add_argument("--mass-cost", type=int, default=0, metavar="N",
                   help="instead: time N alternated zipcache.attend calls over one layer of --prompt tokens "
                        "and a full residual, without masses, mass=True and a MassAccumulator")
    args = p.parse_args(argv)
    if not 0.0 <= args.query_correlation < 1.0:
        p.error("--query-correlation must be in [0, 1)")
    if args.q_heads % args.kv_heads:
        p.error("--q-heads must be a multiple of --kv-heads")
    if min(args.layers, args.prompt, args.kv_heads, args.head_dim, args.eval_every,
           args.threads) < 1 or args.steps < 0:
        p.error("sizes must be positive")
    return args


class SyntheticLayer:
    """One layer's token stream: K with outlier channels and a sink, V and Q normal."""

    def __init__(self, rng: np.random.Generator, kv_heads: int, q_heads: int, head_dim: int,
                 query_correlation: float = 0.0) -> None:
        self.rng = rng
        self.correlation = query_correlation
        self.last_query: np.ndarray | None = None
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
        q = self.rng.standard_normal((b, self.q_heads, d), dtype=np.float32)
        if self.correlation and self.last_query is not None:
            c = np.float32(self.correlation)
            q = c * self.last_query + np.sqrt(np.float32(1) - c * c) * q
        self.last_query = q
        return q


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One query token per head, grouped-query: q [B, Hq, D], k/v [B, Hkv, T, D] -> [B, Hq, D],
    in the dtype of k (float32 for the fp16 view path, float64 for the reference)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.astype(k.dtype).reshape(b, hkv, hq // hkv, d) / np.sqrt(d).astype(k.dtype)
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
        d2 = float(np.sum((out.astype(np.float64) - exact) ** 2))
        r2 = float(np.sum(exact ** 2))
        self.diff2 += d2
        self.ref2 += r2
        self.worst = max(self.worst, np.sqrt(d2 / r2) if r2 else 0.0)
        self.steps += 1

    @property
    def relative(self) -> float:
        return float(np.sqrt(self.diff2 / self.ref2)) if self.ref2 else 0.0


def overall(errors: list[LayerError]) -> float:
    ref2 = sum(e.ref2 for e in errors)
    return float(np.sqrt(sum(e.diff2 for e in errors) / ref2)) if ref2 else 0.0


def rel(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@dataclass
class PathResult:
    """One decode run: errors per layer, the daemon's figures, the time spent."""

    name: str
    errors: list[LayerError]
    k_err: list[float] = field(default_factory=list)
    v_err: list[float] = field(default_factory=list)
    stats: zipcache.SessionStats | None = None
    memory: dict[str, int] = field(default_factory=dict)  # memory_stats while the session held it
    fp16_bytes: int = 0
    update_s: float = 0.0    # decode steps' update_and_fetch, all layers
    attend_s: float = 0.0    # the evaluated steps' attention, all layers
    decode_steps: int = 0
    evaluated_steps: int = 0

    @property
    def held_bytes(self) -> int:
        return self.memory.get("file_bytes", 0)


MEMORY_KINDS = ("charged_bytes", "file_bytes", "views_bytes", "blocks_bytes", "residual_bytes",
                "index_bytes", "headers_bytes")


def run_path(args: argparse.Namespace, client: zipcache.Client, name: str) -> PathResult:
    """The whole decode over one session; the same data for either path (same seed)."""
    compressed = name != "fp16 view"
    by_attention = name == BY_ATTENTION or (name == "compressed" and args.saliency == "attention")
    rng = np.random.default_rng(args.seed)
    codec = zipcache.CodecConfig(args.hi_bits, args.lo_bits, args.hi_fraction, args.group_size,
                                 quantize_values=not args.exact_values,
                                 saliency="attention" if by_attention else "key_norm")
    total_tokens = args.prompt + args.steps
    layers = [SyntheticLayer(rng, args.kv_heads, args.q_heads, args.head_dim, args.query_correlation)
              for _ in range(args.layers)]
    shape = (1, args.kv_heads, total_tokens, args.head_dim)
    # The exact fp16 cache, widened (exactly) to float64 for the reference.
    exact_k = [np.zeros(shape, np.float64) for _ in layers]
    exact_v = [np.zeros(shape, np.float64) for _ in layers]
    result = PathResult(name, [LayerError() for _ in layers])
    before = client.memory_stats()

    with client.open_session(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                             max_tokens=total_tokens, codec=codec, policy=args.policy,
                             residual_tokens=args.residual,
                             views="none" if compressed else "full") as session:
        # The masses each attend call measures, summed per residual token
        # and sent with the layer's next update (saliency="attention").
        masses = zipcache.MassAccumulator(session, normalize=not args.unnormalized) if by_attention else False
        offset = 0
        for step in range(-1, args.steps):
            evaluate = step >= 0 and step % args.eval_every == 0
            n = args.prompt if step < 0 else 1
            for i, layer in enumerate(layers):
                k, v = layer.kv(n)
                exact_k[i][:, :, offset:offset + n] = k
                exact_v[i][:, :, offset:offset + n] = v
                t0 = time.perf_counter()
                fetched = session.update_and_fetch(i, k, v)
                if step >= 0:
                    result.update_s += time.perf_counter() - t0
                if not evaluate:
                    continue
                q = layer.query()
                t0 = time.perf_counter()
                if compressed:
                    out = zipcache.attend(session, i, q[:, :, None, :], threads=args.threads,
                                          mass=masses)[:, :, 0, :]
                else:
                    keys, values = fetched
                    out = attention(q, keys.astype(np.float32), values.astype(np.float32))
                result.attend_s += time.perf_counter() - t0
                end = offset + n
                result.errors[i].add(out, attention(q, exact_k[i][:, :, :end], exact_v[i][:, :, :end]))
            offset += n
            result.decode_steps += step >= 0
            result.evaluated_steps += evaluate

        after = client.memory_stats()
        result.memory = {kind: getattr(after, kind) - getattr(before, kind) for kind in MEMORY_KINDS}
        result.stats = session.stats()
        for i in range(args.layers):
            keys, values = session.reconstruct_layer(i) if compressed else session.view(i)
            result.k_err.append(rel(keys, exact_k[i]))
            result.v_err.append(rel(values, exact_v[i]))
    result.fp16_bytes = args.layers * args.kv_heads * total_tokens * args.head_dim * 2 * 2
    return result


def report_saliency(args: argparse.Namespace, by_norm: PathResult, by_mass: PathResult) -> dict:
    """key_norm vs attention ranking of the same decode: output error at equal stored bytes."""
    stored = [sum(l.compressed_bytes for l in r.stats.layers) for r in (by_norm, by_mass)]
    if stored[0] != stored[1]:
        raise SystemExit(f"attention_decode: stored bytes differ ({stored[0]} vs {stored[1]}): "
                         "the comparison is not at equal bytes")
    e_norm, e_mass = overall(by_norm.errors), overall(by_mass.errors)
    # The steps after the first decode flush: before it both are the same bytes.
    print(f"\nsaliency of the residual's flushes, same data, {stored[0]} stored bytes for both:")
    print(f"  key_norm   attn rel err {e_norm:.5%}  worst step {max(e.worst for e in by_norm.errors):.4%}")
    print(f"  attention  attn rel err {e_mass:.5%}  worst step {max(e.worst for e in by_mass.errors):.4%}"
          f"  ({'unnormalized sums' if args.unnormalized else 'mean mass per step seen'})")
    print(f"  attention / key_norm: {e_mass / e_norm:.4f} "
          f"({'lower' if e_mass < e_norm else 'not lower'} with attention)")
    ms = [1e3 * r.attend_s / max(r.evaluated_steps, 1) for r in (by_norm, by_mass)]
    print(f"  attention/step {ms[0]:.3f} ms by key norm, {ms[1]:.3f} ms with the masses "
          f"(their second score pass and the accumulator)")
    return {"saliency_compare": True, "stored_bytes": stored[0], "key_norm_error": e_norm,
            "attention_error": e_mass, "ratio": e_mass / e_norm,
            "query_correlation": args.query_correlation, "normalized": not args.unnormalized,
            "prompt": args.prompt, "steps": args.steps, "layers": args.layers,
            "residual": args.residual, "hi_fraction": args.hi_fraction,
            "exact_values": args.exact_values, "attend_ms_key_norm": ms[0], "attend_ms_attention": ms[1]}


def report(args: argparse.Namespace, results: list[PathResult]) -> None:
    c, f = results[0], results[1]
    print(f"{'layer':>5}  {'attn err compr':>14}  {'attn err fp16':>13}  {'worst step':>10}  "
          f"{'K rel err':>9}  {'V rel err':>9}  {'fp16 KiB':>9}  {'stored KiB':>10}  {'stored/fp16':>11}")
    for i, layer_stats in enumerate(c.stats.layers):
        print(f"{i:>5}  {c.errors[i].relative:>14.4%}  {f.errors[i].relative:>13.4%}  "
              f"{c.errors[i].worst:>10.4%}  {c.k_err[i]:>9.4%}  {c.v_err[i]:>9.4%}  "
              f"{layer_stats.fp16_bytes / 1024:>9.1f}  {layer_stats.compressed_bytes / 1024:>10.1f}  "
              f"{layer_stats.compressed_bytes / layer_stats.fp16_bytes:>11.3f}")
    print()
    print(f"{'path':<34}  {'attn rel err':>12}  {'worst step':>10}  {'held/fp16':>9}  "
          f"{'attention/step':>14}  {'update/step':>11}")
    for r, label in ((c, 'views="none" + zipcache.attend'), (f, 'views="full" + numpy float32')):
        attend_ms = 1e3 * r.attend_s / max(r.evaluated_steps, 1)
        update_ms = 1e3 * r.update_s / max(r.decode_steps, 1)
        print(f"{label:<34}  {overall(r.errors):>12.4%}  {max(e.worst for e in r.errors):>10.4%}  "
              f"{r.held_bytes / r.fp16_bytes:>9.3f}  {attend_ms:>11.3f} ms  {update_ms:>8.3f} ms")
    print(f"\n(over {c.evaluated_steps} of {args.steps} decode steps x {args.layers} layers; times are "
          f"the sum over the layers of one step)")
    fp16 = c.fp16_bytes
    for r in results[:2]:
        m = r.memory
        print(f"{r.name:>10}: the daemon holds {m['file_bytes'] / 2**20:.2f} MiB for {fp16 / 2**20:.2f} MiB "
              f"of fp16 K/V ({m['file_bytes'] / fp16:.3f}): views {m['views_bytes'] / 2**20:.2f}, blocks "
              f"{m['blocks_bytes'] / 2**20:.2f}, residual {m['residual_bytes'] / 2**20:.2f}, index and "
              f"headers {(m['index_bytes'] + m['headers_bytes']) / 2**20:.2f} MiB")
    ratio = (c.attend_s / max(c.evaluated_steps, 1)) / max(f.attend_s / max(f.evaluated_steps, 1), 1e-12)
    print(f"attention time, compressed / fp16 view + numpy: {ratio:.3f}")
    if len(results) > 2:
        figures = report_saliency(args, results[0], results[2])
        if args.json:
            print(json.dumps(figures))


def mass_cost(args: argparse.Namespace, client: zipcache.Client) -> dict:
    """What asking for the masses costs one attend call: medians of alternated calls."""
    rng = np.random.default_rng(args.seed)
    residual = args.residual or 128
    layer = SyntheticLayer(rng, args.kv_heads, args.q_heads, args.head_dim)
    codec = zipcache.CodecConfig(args.hi_bits, args.lo_bits, args.hi_fraction, args.group_size,
                                 saliency="attention")
    with client.open_session(layers=1, kv_heads=args.kv_heads, head_dim=args.head_dim,
                             max_tokens=args.prompt + residual, codec=codec, residual_tokens=residual,
                             views="none") as session:
        session.update_and_fetch(0, *layer.kv(args.prompt))
        for _ in range(residual - 1):  # a residual one token short of its flush
            session.update_and_fetch(0, *layer.kv(1))
        q = layer.query()[:, :, None, :]
        accumulator = zipcache.MassAccumulator(session)
        times: dict[str, list[float]] = {"none": [], "mass": [], "accumulator": []}
        for _ in range(args.mass_cost):
            for name, mass in (("none", False), ("mass", True), ("accumulator", accumulator)):
                t0 = time.perf_counter()
                zipcache.attend(session, 0, q, threads=args.threads, mass=mass)
                times[name].append(time.perf_counter() - t0)
    us = {name: 1e6 * float(np.median(t)) for name, t in times.items()}
    print(f"one attend call over {args.prompt} + {residual - 1} tokens (H_kv {args.kv_heads}, q_heads "
          f"{args.q_heads}, D {args.head_dim}), median of {args.mass_cost}: {us['none']:.1f} us; "
          f"mass=True {us['mass']:.1f} us ({us['mass'] / us['none']:.3f}); MassAccumulator "
          f"{us['accumulator']:.1f} us ({us['accumulator'] / us['none']:.3f})")
    return {"mass_cost": True, "tokens": args.prompt + residual - 1, "residual_rows": residual - 1,
            "calls": args.mass_cost, "attend_us": us["none"], "mass_us": us["mass"],
            "accumulator_us": us["accumulator"]}


def main(argv: list[str] | None = None) -> list[PathResult]:
    args = parse_args(argv)
    if args.mass_cost:
        with zipcache.Client(args.socket) as client:
            figures = mass_cost(args, client)
        if args.json:
            print(json.dumps(figures))
        return []
    with zipcache.Client(args.socket) as client:
        info = client.server_info
        print(f"zipcached {info.server_version} at {args.socket}: {args.layers} layers x "
              f"[1, {args.kv_heads}, <= {args.prompt + args.steps}, {args.head_dim}] fp16, "
              f"{args.q_heads} query heads")
        print(f"codec {args.hi_bits}/{args.lo_bits} bits, {args.hi_fraction:.0%} salient, groups of "
              f"{args.group_size}; policy {args.policy}; prefill {args.prompt} tokens, then "
              f"{args.steps} decode steps; compressed path's flushes ranked by "
              f"{'key norm and by attention' if args.saliency == 'both' else args.saliency.replace('_', ' ')}\n")
        paths = PATHS + ((BY_ATTENTION,) if args.saliency == "both" else ())
        results = [run_path(args, client, name) for name in paths]
    report(args, results)
    return results


if __name__ == "__main__":
    try:
        main()
    except zipcache.ZipCacheError as exc:
        print(f"attention_decode: {exc}", file=sys.stderr)
        sys.exit(1)
