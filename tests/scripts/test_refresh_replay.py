"""benchmarks/refresh_replay.py replays the hybrid refresh rule through the policy's own code: a
routing that moves to new experts is taken in after one window, later by the lags asked for."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _replay():
    spec = importlib.util.spec_from_file_location("refresh_replay", ROOT / "benchmarks" / "refresh_replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.replay


def test_new_experts_are_taken_in_at_a_window_end_and_each_token_of_lag_costs_their_hits():
    replay = _replay()
    prompt, decode, k = 16, 40, 4
    rows = np.array([list(range(k))] * prompt + [list(range(k, 2 * k))] * decode)   # the routing moves on
    base, pairs, promoted = replay(rows, num_experts=16, capacity=k, prompt=prompt, every=4, act_lag=0, land_lag=0)
    assert pairs == decode * k and promoted == k
    missed_tokens = decode - base // k
    assert base % k == 0 and 0 < missed_tokens < decode and missed_tokens % 4 == 0   # taken in at a window's end
    for act_lag, land_lag in ((1, 0), (0, 1), (1, 1), (2, 1)):
        hits, _, promoted = replay(rows, num_experts=16, capacity=k, prompt=prompt, every=4, act_lag=act_lag,
                                   land_lag=land_lag)
        assert promoted == k and hits == base - (act_lag + land_lag) * k, (act_lag, land_lag)
    kept, _, none = replay(rows, num_experts=16, capacity=k, prompt=prompt, every=0, act_lag=0, land_lag=0)
    assert none == 0 and kept == 0                          # never refreshed: the prompt's fill misses them all
