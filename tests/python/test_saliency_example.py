"""Saliency chosen by the caller: zipcache.codec.compress(..., scores=) and
examples/saliency_attention.py, which compares key-norm and attention
ranking of the residual's flushes at equal stored bytes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from zipcache import CodecConfig, codec
from zipcache.errors import InvalidArgument

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example():
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location("saliency_attention", EXAMPLES / "saliency_attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _keys(seed: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, 2, 96, 32)).astype(np.float16)


def test_scores_that_rank_like_the_norms_give_the_same_payload():
    k = _keys()
    norms = np.linalg.norm(k.astype(np.float64), axis=-1)
    assert codec.compress(k, "keys", scores=norms) == codec.compress(k, "keys")


def test_scores_choose_the_salient_tokens():
    k = _keys()
    config = CodecConfig()
    rising = np.broadcast_to(np.arange(96, dtype=np.float32), (1, 2, 96))
    falling = rising[..., ::-1].copy()
    a = codec.compress(k, "keys", config, scores=rising)
    b = codec.compress(k, "keys", config, scores=falling)
    assert len(a) == len(b) == len(codec.compress(k, "keys", config))  # equal bytes
    assert a != b
    # The rows the scores favour come back closer: the last tokens under
    # rising scores, the first under falling ones.
    err_a = np.abs(codec.reconstruct(a, k.shape, "keys", config).astype(np.float32) - k)
    err_b = np.abs(codec.reconstruct(b, k.shape, "keys", config).astype(np.float32) - k)
    assert err_a[..., -16:, :].mean() < err_b[..., -16:, :].mean()
    assert err_b[..., :16, :].mean() < err_a[..., :16, :].mean()


@pytest.mark.parametrize("value", [np.nan, -1.0, np.inf])
def test_bad_scores_are_refused(value):
    k = _keys()
    scores = np.ones((1, 2, 96), np.float32)
    scores[0, 1, 7] = value
    with pytest.raises(InvalidArgument):
        codec.compress(k, "keys", scores=scores)


def test_scores_must_fit_the_block_and_be_for_keys():
    k = _keys()
    with pytest.raises(ValueError):
        codec.compress(k, "keys", scores=np.ones(95, np.float32))
    with pytest.raises(ValueError):
        codec.compress(k, "values", scores=np.ones((1, 2, 96), np.float32))


def test_saliency_example_runs_at_equal_bytes(capsys):
    results = _example().main(["--prompt", "64", "--steps", "80", "--residual", "32",
                               "--kv-heads", "2", "--q-heads", "4", "--head-dim", "32",
                               "--query-correlation", "0.9", "--json"])
    rankings, summary = results[:-1], results[-1]
    assert [r["ranking"] for r in rankings] == ["key_norm", "attention", "random"]
    assert len({r["stored_bytes"] for r in rankings}) == 1
    for r in rankings:
        assert r["flushes"] == 2
        assert 0.001 < r["relative_error"] < 0.5
    assert summary["attention_over_key_norm_error"] > 0
    assert capsys.readouterr().out.count("\n") == 4
