"""Expert profiles (record, save, load, pin, seed) and routing traces (record, replay), on CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import moestream
from moestream.bench import TraceRouting, use_routing
from moestream.cli import main as cli_main
from moestream.errors import InputError
from moestream.model.routers import ObservedRouter
from moestream.warmstart.profile import Profile, apply_profile, record_profile
from moestream.warmstart.trace import RoutingTrace, record_profile_and_trace, record_trace

PROMPTS = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 19, 11)]
OTHER = [torch.randint(2, 160, (len(p),), generator=torch.Generator().manual_seed(100 + i)).tolist()
         for i, p in enumerate(PROMPTS)]


def _load(folder, **kw):
    return moestream.load(folder, device="cpu", dtype="float32", **kw)


def _hand_profile(freqs: dict[int, list[float]], tokens: int = 100) -> Profile:
    return Profile(arch="qwen3_moe", num_layers=3, num_experts=8, top_k=2, checkpoint="qwen3_moe", tokens=tokens,
                   frequencies=freqs, prompts=1)


class Observer:
    """Keeps every routing a model makes, per layer, on the host (tests only)."""

    def __init__(self, engine):
        self.ids = {b.layer: [] for b in engine.model.moe_blocks()}
        for b in engine.model.moe_blocks():
            b.swap_router(ObservedRouter(b.router, lambda ids, layer=b.layer: self.ids[layer].append(ids.clone())))

    def stacked(self) -> np.ndarray:
        return torch.stack([torch.cat(v) for v in self.ids.values()], dim=1).numpy()


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    return _load(tiny_qwen3)


@pytest.fixture(scope="module")
def recorded(engine):
    return record_profile_and_trace(engine, PROMPTS, max_tokens=3)


# ---- profiles ------------------------------------------------------------------------------
def test_profile_round_trip_and_fractions(engine, recorded, tmp_path):
    profile, trace = recorded
    assert profile.tokens == sum(len(p) + 3 for p in PROMPTS) == trace.tokens
    assert sorted(profile.frequencies) == [0, 2]   # layer 1 is dense
    for f in profile.frequencies.values():
        assert len(f) == 8 and sum(f) == pytest.approx(engine.config.top_k)
        assert all(0 <= x <= 1 for x in f)
    path = tmp_path / "p.json"
    profile.save(path)
    assert not list(tmp_path.glob("*.tmp"))
    assert Profile.load(path, engine.config) == profile
    # the separate recorder agrees with the combined one, and observers are detached afterwards
    assert record_profile(engine, PROMPTS, max_tokens=3) == profile
    assert not any(isinstance(b.router, ObservedRouter) for b in engine.model.moe_blocks())


def test_profile_counts_match_the_trace(recorded):
    profile, trace = recorded
    for i, layer in enumerate(trace.layers):
        counts = np.bincount(trace.ids[:, i].reshape(-1), minlength=8)
        assert np.allclose(np.asarray(profile.frequencies[layer]) * profile.tokens, counts)


@pytest.mark.parametrize("change,match", [
    (lambda d: [d["model"].update(num_experts=16)] + [f.extend([0.0] * 8) for f in d["frequencies"].values()],
     "16 experts"),
    (lambda d: d["model"].update(num_layers=4), "4 layers"),
    (lambda d: d["model"].update(top_k=4), "top-4"),
    (lambda d: d["frequencies"].pop("2"), "MoE layers"),
    (lambda d: d["frequencies"]["0"].append(0.0), "bad frequencies"),
    (lambda d: d.pop("tokens"), "not a moestream profile"),
])
def test_mismatched_profile_is_refused(engine, recorded, tmp_path, change, match):
    data = recorded[0].as_dict()
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match=match):
        Profile.load(path, engine.config)


def test_broken_or_missing_profile_is_refused(tiny_qwen3, engine, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"format": "moestream-profile", "mod')
    with pytest.raises(InputError, match="not valid JSON"):
        Profile.load(path, engine.config)
    with pytest.raises(InputError, match="does not exist"):
        _load(tiny_qwen3, profile=tmp_path / "missing.json")
    with pytest.raises(InputError, match="need a profile"):
        _load(tiny_qwen3, pin_top_k=2)


def test_pinned_sets_from_top_k_and_threshold():
    p = _hand_profile({0: [0.9, 0.0, 0.3, 0.05, 0.4, 0.0, 0.35, 0.0],
                       2: [0.1, 0.2, 0.3, 0.4, 0.5, 0.25, 0.15, 0.1]})
    assert p.pinned(top_k=2) == {0: [0, 4], 2: [3, 4]}
    assert p.pinned(top_k=6) == {0: [0, 2, 3, 4, 6], 2: [1, 2, 3, 4, 5, 6]}   # never-used experts are not pinned
    assert p.pinned(threshold=0.3) == {0: [0, 4, 6], 2: [3, 4]}               # strictly more than 30% of tokens
    assert p.pinned(threshold=0.95) == {}
    assert p.pinned() == {}
    with pytest.raises(InputError):
        p.pinned(top_k=2, threshold=0.5)
    with pytest.raises(InputError):
        p.pinned(threshold=1.5)


def test_pinned_experts_survive_eviction_pressure(tiny_qwen3, recorded, tmp_path):
    profile, _ = recorded
    path = tmp_path / "p.json"
    profile.save(path)
    for kw in ({"pin_top_k": 2}, {"pin_threshold": 0.3}):
        expected = profile.pinned(kw.get("pin_top_k"), kw.get("pin_threshold"))
        assert expected and all(len(v) <= 3 for v in expected.values())
        engine = _load(tiny_qwen3, capacity=5, profile=path, **kw)
        assert {k: sorted(v) for k, v in engine.bank.policy.pinned.items() if v} == expected
        assert engine.stats()["evictions"] == 0   # seeding at load is not counted
        engine.generate(OTHER, max_tokens=25, ignore_eos=True)
        engine.generate(PROMPTS[1], max_tokens=25, ignore_eos=True)
        assert engine.stats()["evictions"] > 0
        for layer, experts in expected.items():
            bank = engine.bank.layers[layer]
            for e in experts:
                assert e in bank.where and int(bank.slot_map[e]) == bank.where[e]


def test_too_many_pins_for_the_capacity_is_refused(tiny_qwen3, tmp_path):
    path = tmp_path / "p.json"
    _hand_profile({0: [0.5] * 4 + [0.0] * 4, 2: [0.5] * 4 + [0.0] * 4}).save(path)
    with pytest.raises(moestream.MoestreamError, match="pin fewer"):
        _load(tiny_qwen3, capacity=4, profile=path, pin_top_k=4)


def test_seeding_puts_the_profile_top_experts_in_the_bank(tiny_qwen3, tmp_path):
    freqs = {0: [0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7], 2: [0.6, 0.0, 0.0, 0.5, 0.0, 0.4, 0.3, 0.2]}
    path = tmp_path / "p.json"
    _hand_profile(freqs).save(path)
    engine = _load(tiny_qwen3, capacity=3, profile=path)
    assert set(engine.bank.layers[0].where) == {5, 6, 7}
    assert set(engine.bank.layers[2].where) == {0, 3, 5}
    assert apply_profile(engine, Profile.load(path)) == 0   # the first fill already held them
    for layer in (0, 2):
        ranking = engine.bank.policy.ranking(layer)
        assert ranking[:3] == sorted(range(8), key=lambda e: -freqs[layer][e])[:3]
    # with a pin, the pinned expert plus the best of the rest
    engine = _load(tiny_qwen3, capacity=3, profile=path, pinned={0: [0]})
    assert set(engine.bank.layers[0].where) == {0, 6, 7}
    # the same tokens as without a profile: seeding changes residency, never results
    plain = _load(tiny_qwen3, capacity=3)
    reference = plain.generate(PROMPTS[1], max_tokens=10, ignore_eos=True)
    assert engine.generate(PROMPTS[1], max_tokens=10, ignore_eos=True) == reference
    # seeding a running engine swaps the profile's experts in (LRU too: the profile decides the fill)
    for residency in ("lcp", "lru"):
        running = _load(tiny_qwen3, capacity=3, residency=residency)
        running.generate(PROMPTS[0], max_tokens=5, ignore_eos=True)
        assert apply_profile(running, Profile.load(path)) > 0
        assert set(running.bank.layers[0].where) == {5, 6, 7} and set(running.bank.layers[2].where) == {0, 3, 5}
        for layer, b in running.bank.layers.items():
            assert all(int(b.slot_map[e]) == s for e, s in b.where.items())
            assert int((b.slot_map >= 0).sum()) == 3
        assert running.generate(PROMPTS[1], max_tokens=10, ignore_eos=True) == reference


def test_seeding_a_full_bank_changes_no_residency(tiny_qwen3, tmp_path):
    engine = _load(tiny_qwen3)
    before = {l: b.slot_map.clone() for l, b in engine.bank.layers.items()}
    profile = _hand_profile({0: [0.0] * 6 + [1.0, 1.0], 2: [1.0, 1.0] + [0.0] * 6})
    assert apply_profile(engine, profile) == 0
    for layer, b in engine.bank.layers.items():
        assert torch.equal(b.slot_map, before[layer])


# ---- routing traces ------------------------------------------------------------------------
def test_trace_replay_gives_exactly_the_recorded_ids(tiny_qwen3, recorded, tmp_path):
    _, trace = recorded
    path = tmp_path / "t.json"
    trace.save(path)
    loaded = RoutingTrace.load(path)
    assert np.array_equal(loaded.ids, trace.ids) and loaded.layers == [0, 2] and loaded.name == "t.json"
    assert loaded.ids.shape == (trace.tokens, 2, 2)

    engine = _load(tiny_qwen3, capacity=3)
    reference = engine.generate(PROMPTS, max_tokens=4, ignore_eos=True)
    routing = TraceRouting.for_engine(loaded, engine)
    use_routing(engine, routing)
    seen = Observer(engine)
    # other prompts of the same lengths: the routing is still the recorded one, token by token
    for p in OTHER:
        engine.generate(p, max_tokens=4, ignore_eos=True)
    assert np.array_equal(seen.stacked(), trace.ids)
    # same prompts from the start of the trace: same routing and weights, so the same tokens
    routing.reset()
    assert engine.generate(PROMPTS, max_tokens=4, ignore_eos=True) == reference


def test_trace_replay_wraps_and_maps_layers_modulo():
    ids = np.array([[[0, 1]], [[2, 3]], [[4, 5]]])   # 3 tokens, 1 trace layer
    trace = RoutingTrace(num_experts=8, top_k=2, layers=[5], ids=ids)
    routing = TraceRouting(trace, "cpu", [0, 2], num_experts=8, top_k=2)
    logits = torch.randn(2, 8)
    got = []
    for _ in range(3):   # two forwards of 2 tokens each... and a third: rows 0,1 | 2,0 | 1,2
        w0, a = routing(0, logits)
        _, b = routing(2, logits)
        assert torch.equal(a, b) and torch.allclose(w0.sum(-1), torch.ones(2))
        got.append(a)
    assert torch.cat(got).tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3], [4, 5]]
    w, ids = routing(0, logits)
    probs = logits.softmax(-1).gather(-1, ids)
    assert torch.allclose(w, probs / probs.sum(-1, keepdim=True)) and w.dtype == torch.float32


def test_trace_replay_has_no_data_dependent_host_code():
    """What breaks a CUDA-graph capture (.item(), .tolist(), host branches on values) breaks a
    full-graph trace too: the override must trace as one graph."""
    trace = RoutingTrace(num_experts=8, top_k=2, layers=[0],
                         ids=np.array([[[1, 2]], [[3, 4]], [[5, 6]]]))
    routing = TraceRouting(trace, "cpu", 1, num_experts=8, top_k=2)
    compiled = torch.compile(lambda logits: routing(0, logits), backend="eager", fullgraph=True)
    _, ids = compiled(torch.randn(2, 8))
    _, ids2 = compiled(torch.randn(2, 8))
    assert ids.tolist() == [[1, 2], [3, 4]] and ids2.tolist() == [[5, 6], [1, 2]]
    assert int(routing.cursor) == 1


def test_trace_with_other_experts_or_top_k_is_refused(engine, recorded, tmp_path):
    _, trace = recorded
    wrong = RoutingTrace(num_experts=16, top_k=2, layers=trace.layers, ids=trace.ids, name="wrong.json")
    with pytest.raises(InputError, match="16 experts"):
        TraceRouting.for_engine(wrong, engine)
    wrong = RoutingTrace(num_experts=8, top_k=3, layers=[0], ids=np.array([[[0, 1, 2]]]), name="k3.json")
    with pytest.raises(InputError, match="top-3"):
        TraceRouting.for_engine(wrong, engine)
    bad = trace.as_dict()
    bad["ids"][0][0] = [9, 1]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(InputError, match="outside"):
        RoutingTrace.load(path)
    path.write_text("[1, 2")
    with pytest.raises(InputError, match="not valid JSON"):
        RoutingTrace.load(path)


def test_record_trace_alone_matches(engine, recorded):
    assert np.array_equal(record_trace(engine, PROMPTS, max_tokens=3).ids, recorded[1].ids)


# ---- command line --------------------------------------------------------------------------
def test_cli_profile_run_and_bench(tiny_qwen3, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(" ".join(map(str, p)) for p in PROMPTS) + "\n\n")
    prof, trace = tmp_path / "p.json", tmp_path / "t.json"
    assert cli_main(["profile", str(tiny_qwen3), "--device", "cpu", "--prompts", str(prompts), "--out", str(prof),
                     "--max-tokens", "2", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert f"{sum(len(p) + 2 for p in PROMPTS)} tokens (3 prompts)" in out and "layer   0  e" in out
    assert Profile.load(prof).tokens == RoutingTrace.load(trace).tokens == sum(len(p) + 2 for p in PROMPTS)

    assert cli_main(["profile", str(tiny_qwen3), "--device", "cpu", "--prompts", str(prompts), "--out",
                     str(tmp_path / "c.json"), "--chunk-tokens", "10"]) == 0
    assert "37 tokens (4 prompts)" in capsys.readouterr().out

    assert cli_main(["run", str(tiny_qwen3), "-p", "3 4 5", "--max-tokens", "4", "--device", "cpu", "--capacity", "4",
                     "--profile", str(prof), "--pin-top-k", "2"]) == 0
    assert len(capsys.readouterr().out.split()) == 4

    result = tmp_path / "bench.json"
    assert cli_main(["bench", str(tiny_qwen3), "--device", "cpu", "--capacity", "3", "--prompt-tokens", "12",
                     "--gen-tokens", "6", "--routing-trace", str(trace), "--profile", str(prof),
                     "--pin-threshold", "0.5", "--json", str(result)]) == 0
    assert json.loads(result.read_text())["routing"] == "trace replay (t.json)"
    capsys.readouterr()


@pytest.mark.parametrize("args,match", [
    (["run", "-p", "3 4", "--profile", "{tmp}/missing.json"], "does not exist"),
    (["run", "-p", "3 4", "--profile", "{tmp}/broken.json"], "not valid JSON"),
    (["run", "-p", "3 4", "--pin-top-k", "2"], "need a profile"),
    (["bench", "--routing-trace", "{tmp}/broken.json"], "not valid JSON"),
    (["profile", "--prompts", "{tmp}/nothing.txt", "--out", "{tmp}/p.json"], "does not exist"),
])
def test_cli_bad_profile_or_trace_is_one_line(tiny_qwen3, tmp_path, capsys, args, match):
    (tmp_path / "broken.json").write_text("{")
    argv = [args[0], str(tiny_qwen3), "--device", "cpu", *(a.format(tmp=tmp_path) for a in args[1:])]
    assert cli_main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("moestream: error: ") and err.count("\n") == 1 and match in err


def test_cli_profile_on_the_demo_model_text_prompts(tmp_path, capsys):
    """Text prompts through the tokenizer: one per line, and the whole file in token chunks."""
    from moestream.cli import DEMO_MODEL

    text = (DEMO_MODEL / "heldout_sample.txt").read_text()[:3000]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(text)
    lines = [line for line in text.splitlines() if line.strip()][:3]
    few = tmp_path / "few.txt"
    few.write_text("\n".join(lines))
    assert cli_main(["profile", "--device", "cpu", "--prompts", str(few), "--out", str(tmp_path / "a.json")]) == 0
    assert "(3 prompts)" in capsys.readouterr().out
    out = tmp_path / "p.json"
    assert cli_main(["profile", "--device", "cpu", "--prompts", str(prompts), "--out", str(out),
                     "--chunk-tokens", "128", "--max-prompts", "3", "--max-tokens", "2"]) == 0
    summary = capsys.readouterr().out
    assert "390 tokens (3 prompts)" in summary and len(summary.splitlines()) == 1 + 6 + 1
    profile = Profile.load(out)
    assert profile.num_experts == 128 and all(sum(f) == pytest.approx(8) for f in profile.frequencies.values())
