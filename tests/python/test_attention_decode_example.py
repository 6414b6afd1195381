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
