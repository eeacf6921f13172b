"""benchmarks/served_steps.py: concurrent streams stepped as the server steps them, on the CPU with a tiny
checkpoint and a bounded bank: each mode plans the steps it names, and every stream gets all its tokens."""

from __future__ import annotations

import json
from pathlib import Path

from fork_server import run_script

ROOT = Path(__file__).resolve().parents[2]


def test_each_mode_plans_its_steps_and_every_stream_gets_its_tokens(tiny_qwen3, tmp_path):
    """3 prompts of 6 tokens in steps of 8, 4 tokens each: filled steps pack 8 prompt tokens (2 forwards),
    whole prompts one a step (3); decodes ride in prompt forwards only where the mode lets them."""
    run = run_script(ROOT / "benchmarks" / "served_steps.py", "--ckpt", str(tiny_qwen3),
                     "--out", str(tmp_path), "--device", "cpu", "--capacity", "3", "--streams", "3",
                     "--prompt-tokens", "6", "--gen-tokens", "4", "--prefill-chunk", "8", "--routing", "uniform", timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "served_steps.json").read_text())
    modes = result["modes"]
    assert set(modes) == {"default", "no-ride", "whole", "one-each"}
    for mode in modes.values():
        assert sum(s["prompt_tokens"] for s in mode["steps"]) == 3 * 6
        assert mode["decode_tok_s"] > 0 and mode["ttft_p50_ms"] <= mode["ttft_last_ms"]
    assert max(s["prompt_tokens"] for s in modes["default"]["steps"]) == 8   # a prompt cut to fill the step
    assert max(s["prompt_tokens"] for s in modes["whole"]["steps"]) == 6
    assert modes["one-each"]["forwards"] == 3
    assert modes["default"]["decodes_packed"] > 0 and modes["whole"]["decodes_packed"] > 0
    assert modes["no-ride"]["decodes_packed"] == 0 and modes["one-each"]["decodes_packed"] == 0
    assert result["routing"].startswith("uniform")
    assert "no-ride" in run.stdout and "kernel variants compiled" in run.stdout


def test_a_round_per_fixed_batch_share_under_the_hybrid_policy(tiny_qwen3, tmp_path):
    """`--batch-cpu-shares` adds a default round per share with the batch split held there, and
    `--prompt-cpu-misses` one per share of a streamed prompt's misses on the CPU, each reporting its share
    and median step; every stream still gets its tokens."""
    run = run_script(ROOT / "benchmarks" / "served_steps.py", "--ckpt", str(tiny_qwen3),
                     "--out", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--capacity", "2",
                     "--streams", "3", "--prompt-tokens", "6", "--gen-tokens", "4", "--prefill-chunk", "8",
                     "--routing", "uniform", "--hybrid", "--modes", "default", "--batch-cpu-shares", "0.25", "0.75",
                     "--prompt-cpu-misses", "0", "1", timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    modes = json.loads((tmp_path / "served_steps.json").read_text())["modes"]
    assert set(modes) == {"default", "share 0.25", "share 0.75", "prompt cpu 0.0", "prompt cpu 1.0"}
    assert modes["share 0.25"]["batch_cpu_share"] == 0.25 and modes["share 0.75"]["batch_cpu_share"] == 0.75
    assert modes["prompt cpu 1.0"]["prompt_cpu_share"] == 1.0 and modes["default"]["prompt_cpu_share"] == 0.0
    for mode in modes.values():
        assert sum(s["prompt_tokens"] for s in mode["steps"]) == 3 * 6
        assert mode["median_step_ms"] > 0 and mode["steps_taken"] == len(mode["steps"])
