"""The bounded bank on CPU: exact fetch at every capacity, skip, pinning, budgets, statistics, failures."""

import shutil

import pytest
import torch

import moestream
from moestream.cli import main as cli_main
from moestream.errors import BudgetError, CheckpointError
from moestream.engine.plan import plan_memory
from moestream.sizes import parse_bytes

PROMPTS = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 29)]


@pytest.fixture(scope="module")
def reference_tokens(tiny_qwen3):
    full = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    return {"single": full.generate(PROMPTS[1], max_tokens=20, ignore_eos=True),
            "batch": full.generate(PROMPTS, max_tokens=20, ignore_eos=True)}


@pytest.mark.parametrize("residency", ["lcp", "lru"])
@pytest.mark.parametrize("capacity", range(2, 9))
def test_fetch_is_exact_at_every_capacity(tiny_qwen3, reference_tokens, residency, capacity):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=capacity, residency=residency)
    engine.runner.prefill_chunk = 8   # several prompt chunks: the staged path runs too
    assert engine.generate(PROMPTS[1], max_tokens=20, ignore_eos=True) == reference_tokens["single"]
    assert engine.generate(PROMPTS, max_tokens=20, ignore_eos=True) == reference_tokens["batch"]
    stats = engine.stats()
    moe_layers = sum(engine.config.moe_layers)
    routed = stats["tokens"] * engine.config.top_k * moe_layers
    assert stats["hits"] + stats["misses"] == routed
    if capacity < engine.config.num_experts:
        assert stats["misses"] > 0 and stats["bytes_copied"] > 0
    else:
        assert stats["misses"] == 0 and stats["evictions"] == 0


def test_skip_at_full_capacity_is_exact(tiny_qwen3, reference_tokens):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", miss_policy="skip")
    assert engine.generate(PROMPTS, max_tokens=20, ignore_eos=True) == reference_tokens["batch"]


def test_skip_below_capacity_misses_and_refreshes_the_bank(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", miss_policy="skip", capacity=3)
    out = engine.generate(PROMPTS[1], max_tokens=40, ignore_eos=True)
    assert len(out) == 40
    stats = engine.stats()
    assert stats["misses"] > 0 and stats["evictions"] > 0   # cold experts swapped for missed ones


def test_pinned_experts_are_never_evicted(tiny_qwen3):
    pinned = {0: [1, 6], 2: [3]}
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=4, pinned=pinned)
    engine.generate(PROMPTS[1], max_tokens=30, ignore_eos=True)
    engine.generate(PROMPTS[0], max_tokens=30, ignore_eos=True)
    assert engine.stats()["evictions"] > 0
    for layer, experts in pinned.items():
        bank = engine.bank.layers[layer]
        for e in experts:
            assert e in bank.where
            assert int(bank.slot_map[e]) == bank.where[e]


def test_budget_below_minimum_names_the_minimum(tiny_qwen3):
    with pytest.raises(BudgetError, match="minimum"):
        moestream.load(tiny_qwen3, device="cpu", dtype="float32", memory="1MiB")


@pytest.mark.parametrize("capacity", [1, 9])
def test_capacity_outside_topk_to_experts_is_refused(tiny_qwen3, capacity):
    with pytest.raises(BudgetError, match="capacity"):
        moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=capacity)


def test_budget_chooses_the_largest_capacity_that_fits(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=2)
    config = engine.config
    for cap in range(2, 9):
        plan = plan_memory(config, torch.float32, capacity=cap, max_context=256)
        chosen = plan_memory(config, torch.float32, budget=plan.total_bytes, max_context=256)
        assert chosen.capacity >= cap and chosen.total_bytes <= plan.total_bytes


@pytest.mark.parametrize("text,expected", [("16GiB", 16 * 2**30), ("12000MB", 12 * 10**9), ("8G", 8 * 10**9),
                                           ("1.5gib", int(1.5 * 2**30)), ("4096", 4096)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_cli_budget_errors_are_one_line(tiny_qwen3, capsys):
    assert cli_main(["run", str(tiny_qwen3), "-p", "3 4", "--device", "cpu", "--memory", "12XB"]) == 1
    assert cli_main(["run", str(tiny_qwen3), "-p", "3 4", "--device", "cpu", "--memory", "1MiB"]) == 1
    assert cli_main(["run", str(tiny_qwen3), "-p", "3 4", "--device", "cpu", "--capacity", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("moestream: error:") for line in err)


def test_check_reports_the_plan_without_weights(tiny_qwen3, tmp_path, capsys):
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    shutil.copy(tiny_qwen3 / "config.json", only_config / "config.json")
    assert cli_main(["check", str(only_config), "--device", "cpu", "--capacity", "4"]) == 0
    out = capsys.readouterr().out
    assert "capacity          4/8" in out and "minimum budget" in out


def test_run_stats_table_and_json(tiny_qwen3, tmp_path, capsys):
    path = tmp_path / "stats.json"
    assert cli_main(["run", str(tiny_qwen3), "-p", "3 4 5", "--device", "cpu", "--capacity", "3", "--stats",
                     "--stats-json", str(path), "--max-tokens", "6"]) == 0
    import json

    data = json.loads(path.read_text())
    assert data["hits"] + data["misses"] > 0 and "layers" in data
    assert "hit rate" in capsys.readouterr().err


def test_shard_unreadable_mid_run_fails_cleanly(tiny_qwen3, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3, folder)
    engine = moestream.load(folder, device="cpu", dtype="float32", capacity=2)
    shard = folder / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])   # truncated under the running engine
    with pytest.raises(CheckpointError, match="truncated|ended early"):
        engine.generate(PROMPTS[1], max_tokens=10, ignore_eos=True)


def test_bench_reports_hit_rate_and_bytes(tiny_qwen3, tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert cli_main(["bench", str(tiny_qwen3), "--device", "cpu", "--capacity", "3", "--prompt-tokens", "12",
                     "--gen-tokens", "8", "--json", str(path)]) == 0
    import json

    data = json.loads(path.read_text())
    assert 0 <= data["decode_hit_rate"] <= 1 and data["gen_tokens"] == 8 and data["capacity"] == 3
    assert data["decode_cpu_busy_s_per_token"] == 0                     # fetch: the CPU computes no miss
    assert "decode" in capsys.readouterr().out
    assert cli_main(["bench", str(tiny_qwen3), "--device", "cpu", "--capacity", "3", "--prompt-tokens", "12",
                     "--gen-tokens", "8", "--miss-policy", "hybrid", "--host-tier", "pinned", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["decode_cpu_bytes_per_token"] > 0 and data["decode_cpu_busy_s_per_token"] > 0   # the worker's time
    assert "CPU busy per token" in capsys.readouterr().out


@pytest.mark.parametrize("capacity", [2, 4, 7])
def test_prefetch_keeps_fetch_exact_and_scores_its_predictions(tiny_qwen3, reference_tokens, capacity):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=capacity, prefetch=True)
    assert engine.generate(PROMPTS[1], max_tokens=20, ignore_eos=True) == reference_tokens["single"]
    stats = engine.stats()
    assert stats["prediction_accuracy"] is not None and 0 <= stats["prediction_accuracy"] <= 1
    assert stats["layers"]["2"]["predicted_total"] > 0   # layer 2 is predicted from layer 0
    layer = stats["layers"]["2"]
    if layer["prefetched"]:
        assert layer["prefetch_used"] <= layer["prefetched"] and 0 <= layer["hidden_share"] <= 1


def test_prefetch_switches_itself_off_when_predictions_miss(tiny_qwen3):
    from moestream.bench import UniformRouting, use_routing
    from moestream.experts.prefetch import PREFETCH_WARMUP_CALLS

    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=3, prefetch=True)
    use_routing(engine, UniformRouting(engine.config.top_k))   # the router cannot predict random routing
    engine.generate(PROMPTS[0], max_tokens=200, ignore_eos=True)
    layer = engine.stats()["layers"]["2"]
    assert layer["prediction_accuracy"] < 0.5
    # only the first calls (before the accuracy is judged) and rare lucky streaks copy anything
    assert layer["prefetched"] < 0.5 * layer["predicted_total"]
    assert engine.bank.prefetcher.accuracy(2)[1] > PREFETCH_WARMUP_CALLS


def test_decode_perplexity_is_exact_for_fetch_and_shows_skip(tiny_qwen3):
    from moestream.runtime.perplexity import decode_perplexity

    ids = torch.randint(2, 160, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    full = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    reference, scored = decode_perplexity(full, ids, window=32)
    assert scored == len(ids) - 1
    rows = moestream.load(tiny_qwen3, device="cpu", dtype="float32", kv_layout="rows")
    assert full.plan.memory.paged and decode_perplexity(rows, ids, window=32)[0] == pytest.approx(reference, rel=1e-5)
    fetch = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=3)
    assert decode_perplexity(fetch, ids, window=32)[0] == pytest.approx(reference, rel=1e-5)
    skip = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=3, miss_policy="skip")
    assert decode_perplexity(skip, ids, window=32)[0] != pytest.approx(reference, rel=1e-5)
    assert decode_perplexity(full, ids, window=32, max_scored=10)[1] == 10
    assert full.blocks.used == 0   # the blocks lent to the scoring row came back


def test_apply_routing_swaps_in_what_a_benchmark_names(tiny_qwen3):
    from moestream.bench import UniformRouting, apply_routing
    from moestream.errors import InputError
    from moestream.model.routers import ChosenRouter

    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    assert apply_routing(engine, "model") is None
    assert not any(isinstance(b.router, ChosenRouter) for b in engine.model.moe_blocks())
    assert isinstance(apply_routing(engine, "uniform"), UniformRouting)
    assert all(isinstance(b.router, ChosenRouter) for b in engine.model.moe_blocks())
    with pytest.raises(InputError, match="--trace"):
        apply_routing(engine, "trace")


@pytest.mark.parametrize("experts", [None, "int4"])
def test_fetch_is_exact_in_bf16_too(tiny_quant, experts):
    """A bank below E computes resident and streamed experts in separate calls; their pair rows are
    summed as one call sums them, so bf16 tokens equal full residency's bit for bit (not just fp32's)."""
    kw = {"experts": experts} if experts else {}
    prompts = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9)]
    full = moestream.load(tiny_quant, device="cpu", dtype="bfloat16", **kw)
    ids = torch.tensor([prompts[1]])
    expected, logits = full.generate(prompts, max_tokens=16, ignore_eos=True), full.logits(ids)
    for cap in (2, 5):
        engine = moestream.load(tiny_quant, device="cpu", dtype="bfloat16", capacity=cap, **kw)
        assert torch.equal(engine.logits(ids), logits), cap
        assert engine.generate(prompts, max_tokens=16, ignore_eos=True) == expected, cap
