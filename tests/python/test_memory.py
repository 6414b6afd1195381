"""Client.memory_stats(): the sessions' memory as their files hold it, by kind."""

from __future__ import annotations

import numpy as np

import zipcache

from _support import make_keys, make_values


def test_kinds_add_up_to_what_the_files_hold(client, open_session):
    rng = np.random.default_rng(50)
    s = open_session(layers=2, kv_heads=2, head_dim=16, policy="streaming")
    for layer in range(2):
        s.update_and_fetch(layer, make_keys(rng, 1, 2, 200, 16), make_values(rng, 1, 2, 200, 16))
        s.update_and_fetch(layer, make_keys(rng, 1, 2, 3, 16), make_values(rng, 1, 2, 3, 16))
    m = client.memory_stats()
    assert isinstance(m, zipcache.MemoryStats)
    kinds = m.views_bytes + m.blocks_bytes + m.residual_bytes + m.index_bytes + m.headers_bytes
    assert kinds == m.file_bytes
    # Views hold fp16 rows of both layers, K and V: at least 203 tokens of them.
    assert m.views_bytes >= 2 * 2 * 2 * 203 * 16 * 2
    assert 0 < m.blocks_bytes and m.residual_bytes > 0 and m.index_bytes > 0
    assert m.set_aside_files == 0
