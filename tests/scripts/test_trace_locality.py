"""benchmarks/trace_locality.py: the bank's ceiling and a batch's distinct experts, read off a routing trace."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fork_server import run_script

ROOT = Path(__file__).resolve().parents[2]


def test_a_trace_of_known_routing_gives_its_static_and_window_ceilings_and_distinct_experts(tmp_path):
    """8 experts, top-2, 8 tokens, two layers. Layer 0 routes (0, 1) every token: a bank of 2 holds all of it,
    and 4 tokens route 2 distinct experts. Layer 1 routes (0, 1) for 4 tokens, then (2, 3): any 2 fixed experts
    hold half, a bank swapped every 4 tokens all; 4 consecutive tokens route 2 experts, 8 tokens 4."""
    from moestream.warmstart.trace import RoutingTrace

    ids = np.zeros((8, 2, 2), dtype=np.int64)
    ids[:, 0] = [0, 1]
    ids[:4, 1], ids[4:, 1] = [0, 1], [2, 3]
    RoutingTrace(num_experts=8, top_k=2, layers=[1, 3], ids=ids).save(tmp_path / "t.json")
    script = ROOT / "benchmarks" / "trace_locality.py"
    run = run_script(script, "--trace", str(tmp_path / "t.json"), "--out", str(tmp_path), "--capacity", "2",
                     "--window", "4", "--batch", "4", timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "trace_locality.json").read_text())
    (l0, l1) = result["layers"]
    assert (l0["layer"], l0["static"], l0["window"], l0["distinct"]) == (1, 1.0, 1.0, 2.0)
    assert (l1["layer"], l1["static"], l1["window"], l1["distinct"]) == (3, 0.5, 1.0, 2.0)
    assert result["mean"] == {"static": 0.75, "window": 1.0, "distinct": 2.0}
    run = run_script(script, "--trace", str(tmp_path / "t.json"), "--out", str(tmp_path), "--capacity", "2",
                     "--window", "8", "--batch", "8", timeout=120)
    assert json.loads((tmp_path / "trace_locality.json").read_text())["layers"][1]["window"] == 0.5
    assert json.loads((tmp_path / "trace_locality.json").read_text())["layers"][1]["distinct"] == 4.0
    bad = run_script(script, "--trace", str(tmp_path / "t.json"), "--out", str(tmp_path), "--capacity", "9", timeout=120)
    assert bad.returncode != 0 and "--capacity must be 1..8" in bad.stderr
