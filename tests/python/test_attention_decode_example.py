"""examples/attention_decode.py runs (small shapes) and says what it should:
zipcache.attend over a views="none" session gives the attention numpy gets
from a views="full" session's view, and the daemon holds less than the fp16."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "attention_decode.py"


def _example():
    spec = importlib.util.spec_from_file_location("attention_decode", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_attention_decode_runs_and_both_paths_agree(daemon, capsys):
    example = _example()
    # 112 + 16 tokens end on a flush of the residual of 16: everything is compressed.
    compressed, view = example.main(["--socket", daemon.socket_path, "--layers", "2", "--prompt", "112",
                                     "--steps", "16", "--kv-heads", "2", "--q-heads", "8",
                                     "--head-dim", "128", "--residual", "16", "--threads", "2"])
    out = capsys.readouterr().out
    assert 'views="none" + zipcache.attend' in out and 'views="full" + numpy float32' in out
    for a, b in zip(compressed.errors, view.errors):
        assert a.steps == b.steps == 16
        # Same reconstruction, fp32 rounding apart; and the codec does cost something.
        assert a.relative == pytest.approx(b.relative, rel=1e-4)
        assert 0.001 < a.relative < 0.5
    # The views are the fp16 bytes, and only views="full" has them (both
    # count a page of their map under views).
    assert view.memory["views_bytes"] - compressed.memory["views_bytes"] == view.fp16_bytes
    assert compressed.held_bytes < 0.6 * compressed.fp16_bytes < view.held_bytes


def test_attention_decode_saliency_both_at_equal_bytes(daemon, capsys):
    example = _example()
    # 3 flushes of a residual of 16 by each ranking, over the same data.
    results = example.main(["--socket", daemon.socket_path, "--layers", "1", "--prompt", "32",
                            "--steps", "48", "--kv-heads", "2", "--q-heads", "4",
                            "--head-dim", "64", "--residual", "16", "--saliency", "both",
                            "--query-correlation", "0.9", "--json"])
    out = capsys.readouterr().out
    assert len(results) == 3
    by_norm, _, by_mass = results
    assert "attention / key_norm:" in out and '"saliency_compare": true' in out
    stored = [sum(l.compressed_bytes for l in r.stats.layers) for r in (by_norm, by_mass)]
    assert stored[0] == stored[1]
    # The same tokens and queries: the same error until the first decode
    # flush (the prefill block is ranked by key norm either way) ...
    assert by_norm.errors[0].steps == by_mass.errors[0].steps == 48
    # ... and different blocks after it: the masses did change the choice.
    assert by_norm.k_err[0] != by_mass.k_err[0]


def test_attention_decode_mass_cost_runs(daemon, capsys):
    example = _example()
    assert example.main(["--socket", daemon.socket_path, "--prompt", "64", "--kv-heads", "2",
                         "--q-heads", "4", "--head-dim", "64", "--residual", "16",
                         "--mass-cost", "3", "--json"]) == []
    out = capsys.readouterr().out
    assert "mass=True" in out and '"mass_cost": true' in out
