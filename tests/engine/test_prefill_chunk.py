"""`--prefill-chunk auto` (the default): a bounded bank's prompts take the longest chunk (4096, 2048, 1024 tokens)
whose activations cost the bank at most a tenth of its slots; a resident model keeps 512; expert-
parallel ranks keep 512, so every rank splits a prompt alike."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import moestream
from moestream.archs import detect_arch, model_config_from_hf
from moestream.engine.config import EngineConfig, RuntimeConfig
from moestream.engine.plan import (AUTO_CHUNK_KEEPS, AUTO_PREFILL_CHUNKS, DEFAULT_PREFILL_CHUNK, auto_prefill_chunk,
                                   expert_formats, plan_load, plan_memory)
from moestream.errors import BudgetError, InputError
from moestream.quant.recipe import QuantRecipe

ROOT = Path(__file__).resolve().parents[2]


def qwen3_30b(layers: int = 48):
    """Qwen3-30B-A3B's config (the random checkpoint script's), no weights."""
    spec = importlib.util.spec_from_file_location("make_random_checkpoint", ROOT / "scripts/make_random_checkpoint.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    raw = module.build_config("qwen3-30b-a3b", layers, "bf16", False)
    arch = detect_arch(raw)
    return model_config_from_hf(raw, arch), arch


def planner(experts: str, budget: str, context: int = 32768):
    config, arch = qwen3_30b()
    recipe = QuantRecipe.from_dict({"experts": experts}) if experts != "bf16" else QuantRecipe()
    formats = expert_formats(config, torch.bfloat16, recipe)
    return lambda chunk: plan_memory(config, torch.bfloat16, budget, None, max_context=context, prefill_chunk=chunk,
                                     expert_formats=formats, spec=arch, min_capacity=1)


@pytest.mark.parametrize("experts,budget,longer", [("bf16", "16GiB", True), ("int4", "16GiB", True),
                                                    ("int4", "8GiB", False)])
def test_auto_takes_the_longest_chunk_that_keeps_nine_tenths_of_the_bank(experts, budget, longer):
    """bf16 experts at 16 GiB: a 4,096-token chunk costs the bank one slot a layer; int4 experts at 16 GiB: a
    4,096-token chunk also holds the dequantized path's scratch (one group of 32 slots), 8 of 81 slots; at
    8 GiB (13 slots) any chunk from 1,024 tokens costs more than a tenth of the bank."""
    plan_at = planner(experts, budget)
    base, chosen = plan_at(DEFAULT_PREFILL_CHUNK), auto_prefill_chunk(plan_at, 32768)
    assert not base.fully_resident
    assert (chosen.prefill_chunk > DEFAULT_PREFILL_CHUNK) == longer
    assert chosen.capacity >= AUTO_CHUNK_KEEPS * base.capacity
    for chunk in [c for c in AUTO_PREFILL_CHUNKS if c > chosen.prefill_chunk]:   # every longer one costs more
        try:
            assert plan_at(chunk).capacity < AUTO_CHUNK_KEEPS * base.capacity
        except BudgetError:
            pass


def test_auto_keeps_the_default_where_every_expert_is_resident_or_the_context_is_short():
    assert auto_prefill_chunk(planner("bf16", "200GiB"), 32768).prefill_chunk == DEFAULT_PREFILL_CHUNK
    assert auto_prefill_chunk(planner("bf16", "16GiB", context=2048), 2048).prefill_chunk == 2048
    assert auto_prefill_chunk(planner("bf16", "16GiB", context=1000), 1000).prefill_chunk == DEFAULT_PREFILL_CHUNK


def test_auto_counts_every_row_a_step_can_pack():
    """A server of 16 rows with 1,000-token contexts packs up to 16,000 prompt tokens a step: a chunk past
    one context still fills when the prompts arrive together, so auto may take it (one row may not)."""
    plan_at = planner("bf16", "16GiB", context=1000)
    assert auto_prefill_chunk(plan_at, 1000, rows=16).prefill_chunk > 1000
    assert auto_prefill_chunk(plan_at, 1000, rows=1).prefill_chunk == DEFAULT_PREFILL_CHUNK


def test_a_server_packing_prompts_plans_the_chunk_for_its_rows(long_qwen3):
    def chunk(**kw):
        cfg = EngineConfig.from_kwargs(long_qwen3, device="cpu", dtype="float32", capacity=2, max_context=600,
                                       **kw).validate()
        return plan_load(cfg).memory.prefill_chunk

    assert chunk(kv_rows=8, max_batch=8) > 600            # 8 prompts of one step share each expert's stream
    assert chunk(kv_rows=8, max_batch=8, pack_prompts=False) == DEFAULT_PREFILL_CHUNK   # a forward per prompt
    assert chunk() == DEFAULT_PREFILL_CHUNK               # one sequence: no chunk past its context


@pytest.fixture(scope="module")
def long_qwen3(tiny_qwen3, tmp_path_factory):
    """The tiny Qwen3-MoE with 4,096 positions (its own 256 leave no room for a longer chunk)."""
    folder = tmp_path_factory.mktemp("long_qwen3")
    for f in Path(tiny_qwen3).iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((Path(tiny_qwen3) / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return str(folder)


def test_a_bounded_bank_prefills_in_the_chunk_auto_chose_and_gives_the_same_tokens(long_qwen3):
    prompt = [3 + i % 150 for i in range(900)]
    fixed = moestream.load(long_qwen3, device="cpu", dtype="float32", capacity=2, max_context=2048,
                           prefill_chunk=512)
    auto = moestream.load(long_qwen3, device="cpu", dtype="float32", capacity=2, max_context=2048)   # the default
    assert fixed.runner.prefill_chunk == 512 and auto.runner.prefill_chunk == 2048 == auto.plan.memory.prefill_chunk
    assert auto.generate(prompt, max_tokens=6, ignore_eos=True) == fixed.generate(prompt, max_tokens=6, ignore_eos=True)
    assert auto.counters.prefill_chunks == 1 and fixed.counters.prefill_chunks == 2
    resident = moestream.load(long_qwen3, device="cpu", dtype="float32", max_context=2048)
    assert resident.runner.prefill_chunk == DEFAULT_PREFILL_CHUNK


def test_expert_parallel_ranks_keep_the_default_chunk(long_qwen3):
    cfg = EngineConfig.from_kwargs(long_qwen3, device="cpu", dtype="float32", capacity=2, max_context=2048,
                                   prefill_chunk="auto").validate()
    assert plan_load(cfg).memory.prefill_chunk == 2048
    assert plan_load(cfg, experts_here=4).memory.prefill_chunk == DEFAULT_PREFILL_CHUNK


@pytest.mark.parametrize("bad", ["lots", 0, -4, 1.5])
def test_a_chunk_that_is_neither_tokens_nor_auto_is_refused(bad):
    with pytest.raises(InputError, match="prefill_chunk must be"):
        RuntimeConfig(prefill_chunk=bad).validate()


def test_check_shows_the_chunk_auto_chose_and_the_flag_refuses_other_words(long_qwen3, capsys):
    from moestream.cli import main as cli_main

    assert cli_main(["check", long_qwen3, "--device", "cpu", "--capacity", "2", "--max-context", "2048"]) == 0
    assert "prefill chunk     2048 tokens a forward" in capsys.readouterr().out   # auto, the default
    assert cli_main(["check", long_qwen3, "--device", "cpu", "--capacity", "2", "--max-context", "2048",
                     "--prefill-chunk", "512"]) == 0
    assert "prefill chunk     512 tokens a forward" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli_main(["check", long_qwen3, "--prefill-chunk", "lots"])
    assert exit_.value.code != 0 and "--prefill-chunk: must be an integer" in capsys.readouterr().err


def test_warm_up_prompts_hold_a_step_in_the_fewest_prompts_of_one_context_each():
    from moestream.engine.engine import prompt_lengths

    assert prompt_lengths(61, 39) == [39, 22] and prompt_lengths(78, 39) == [39, 39]
    assert prompt_lengths(20, 39) == [20]
    for n in range(1, 200):
        lengths = prompt_lengths(n, 39)
        assert sum(lengths) == n and max(lengths) <= 39 and len(lengths) == -(-n // 39)


def test_a_plan_counts_the_row_a_prompt_chunk_gathers(long_qwen3, tiny_checkpoints):
    """A paged chunk gathers its row's keys and values before attending, and so does a resident model's
    prompt chunk replayed as a graph in a rows cache (its row read by a device index): both layouts count
    one such copy of the whole context; a model whose layers cannot page (no prompt graphs) counts none."""
    from moestream.engine.plan import paged_gather_bytes

    def plan(folder, layout: str):
        return plan_load(EngineConfig.from_kwargs(folder, device="cpu", dtype="bfloat16", max_context=4096,
                                                  kv_layout=layout).validate())

    rows, paged = plan(long_qwen3, "rows"), plan(long_qwen3, "paged")
    gather = paged_gather_bytes(rows.config, torch.bfloat16, 4096)
    assert rows.memory.workspace_bytes == paged.memory.workspace_bytes
    nothing_gathered = dict(kv_blocks=0, max_context=4096, spec=rows.spec, gathers_rows=False)
    assert rows.memory.workspace_bytes - plan_memory(rows.config, torch.bfloat16, **nothing_gathered).workspace_bytes == gather
    ring = plan(tiny_checkpoints["gpt_oss"][0], "rows")   # sliding-window layers: rows only
    assert ring.memory.workspace_bytes == plan_memory(ring.config, torch.bfloat16, kv_blocks=0, max_context=ring.context,
                                                      spec=ring.spec).workspace_bytes
