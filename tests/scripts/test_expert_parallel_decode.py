"""benchmarks/expert_parallel_decode.py runs llama.cpp beside ours: each split mode on the first N GPUs, the
bank share turned into `--n-cpu-moe`, llama-bench's JSON and llama-batched-bench's JSONL read back into rows.
The llama.cpp tools are stand-ins here that record how they were called."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import expert_parallel_decode as ep  # noqa: E402
from benchmarks.llama_cpp import llama_records  # noqa: E402

BENCH = """#!/usr/bin/env python3
import json, os, sys
a = sys.argv[1:]
open(os.environ["CALLS"], "a").write(json.dumps(dict(tool="bench", args=a, gpus=os.environ["CUDA_VISIBLE_DEVICES"])) + "\\n")
modes = a[a.index("-sm") + 1].split(",")
records = [json.dumps(dict(split_mode=m, avg_ts=100.0 + i, n_gen=int(a[a.index("-n") + 1]), gpu_info="H200, H200"),
                      indent=2) for i, m in enumerate(modes)]
if "row" in modes:   # llama-bench ends mid-list where a split mode fails: the runs before it stand
    print("[" + ",".join(records[:modes.index("row")]) + ",")
    sys.exit("llama_bench: error: failed to load model")
print("[" + ",".join(records) + "]")
"""
BATCHED = """#!/usr/bin/env python3
import json, os, sys
a = sys.argv[1:]
open(os.environ["CALLS"], "a").write(json.dumps(dict(tool="batched", args=a, gpus=os.environ["CUDA_VISIBLE_DEVICES"])) + "\\n")
if a[a.index("-sm") + 1] == "row":
    sys.exit("row split not supported")
print("some log line")
print(json.dumps(dict(pl=int(a[a.index("-npl") + 1]), speed_tg=500.0, speed_pp=9000.0)))
"""


@pytest.fixture
def llama(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("llama-bench", BENCH), ("llama-batched-bench", BATCHED)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"num_hidden_layers": 24}))
    monkeypatch.setenv("CALLS", str(tmp_path / "calls.jsonl"))
    args = argparse.Namespace(ckpt=str(ckpt), gguf="/m.gguf", llama_bin=str(bin_dir), llama_split=["layer", "row"],
                              batches=[1, 16], batch_prompt_tokens=64, gen_tokens=32)
    return args, tmp_path / "calls.jsonl"


def _calls(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


needs_shebang = pytest.mark.skipif(os.name == "nt", reason="the stand-in tools are scripts with a shebang")


@needs_shebang
def test_llama_rows_per_split_mode_with_the_bank_as_cpu_moe_layers(llama):
    args, calls = llama
    args.llama_split = ["layer", "tensor"]
    rows = ep.llama_rows(args, world=2, share=0.25)
    assert [r["split"] for r in rows] == ["layer", "tensor"]
    assert all(r["n_cpu_moe"] == 18 and r["gpus"] == 2 and r["bank_share"] == 0.25 for r in rows)
    assert all(r["b1_decode_tok_s"] == 100.0 and r["b16_decode_tok_s"] == 500.0 for r in rows)
    seen = _calls(calls)
    assert {c["gpus"] for c in seen} == {"0,1"}
    bench = [c["args"] for c in seen if c["tool"] == "bench"]
    assert [a[a.index("-sm") + 1] for a in bench] == ["layer", "tensor"]   # one mode a call
    assert all(a[a.index("--n-cpu-moe") + 1] == "18" for a in bench)
    batched = [c["args"] for c in seen if c["tool"] == "batched"]
    assert [a[a.index("-sm") + 1] for a in batched] == ["layer", "tensor"]
    assert all(int(a[a.index("-c") + 1]) >= 16 * (64 + 32) for a in batched)   # every sequence fits the context


@needs_shebang
def test_a_split_mode_llama_cpp_refuses_leaves_the_others_measured(llama):
    args, _ = llama
    args.llama_split = ["row", "layer"]
    rows = ep.llama_rows(args, world=4, share=1.0)
    assert rows[0]["split"] == "row" and "failed to load model" in rows[0]["b1_error"]
    assert "row split not supported" in rows[0]["b16_error"] and "b16_decode_tok_s" not in rows[0]
    assert rows[1]["split"] == "layer" and rows[1]["b1_decode_tok_s"] == 100.0 and rows[1]["b16_decode_tok_s"] == 500.0


@needs_shebang
def test_one_gpu_resident_runs_unsplit_with_every_expert_on_the_gpu(llama):
    args, calls = llama
    rows = ep.llama_rows(args, world=1, share=1.0)
    assert len(rows) == 1 and rows[0]["split"] == "none" and rows[0]["n_cpu_moe"] == 0
    assert {c["gpus"] for c in _calls(calls)} == {"0"}


def test_records_are_read_from_a_list_cut_short_and_from_lines_among_logs():
    first = json.dumps(dict(split_mode="layer", avg_ts=1.5, nested={"a": 1}), indent=2)
    assert llama_records("[" + first + ",\n{\"split_mode\": \"row\", \"avg") == [json.loads(first)]
    lines = 'main: n_kv_max = 1792\n{"pl": 16, "speed_tg": 3.0}\nllama_perf: {not json}\n'
    assert llama_records(lines) == [{"pl": 16, "speed_tg": 3.0}]


def test_the_table_sets_each_row_beside_llama_cpps_best_split_on_as_many_gpus():
    result = {"rows": [dict(gpus=1, bank_share=1.0, routing="uniform (synthetic)", overlap="auto",
                            b1_decode_tok_s=600.0, b16_decode_tok_s=2000.0),
                       dict(gpus=2, bank_share=1.0, routing="uniform (synthetic)", overlap="auto",
                            b1_decode_tok_s=550.0, b16_decode_tok_s=3000.0),
                       dict(gpus=2, bank_share=1.0, overlap="off", b1_decode_tok_s=1.0)],
              "llama_cpp": [dict(gpus=1, bank_share=1.0, split="none", b1_decode_tok_s=400.0, b16_decode_tok_s=1600.0),
                            dict(gpus=2, bank_share=1.0, split="layer", b1_decode_tok_s=390.0, b16_decode_tok_s=1500.0),
                            dict(gpus=2, bank_share=1.0, split="tensor", b1_error="failed", b16_decode_tok_s=1750.0)],
              "allreduce": {"2": {"b1_nccl_allreduce_ms_per_step": 0.5, "b16_nccl_allreduce_ms_per_step": 1.6}}}
    lines = ep.markdown(result).splitlines()
    body = [line for line in lines if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert body == ["| 1 | 1 | 1 | 600.0 | 400.0 (none) | 1.50× | – |",
                    "| 1 | 1 | 16 | 2,000.0 | 1,600.0 (none) | 1.25× | – |",
                    "| 2 | 1 | 1 | 550.0 | 390.0 (layer) | 1.41× | 28% |",      # 0.5 ms of a 1.82 ms step
                    "| 2 | 1 | 16 | 3,000.0 | 1,750.0 (tensor) | 1.71× | 30% |"]   # 1.6 ms of 5.33 ms
    assert lines[-1] == "Our routing: uniform (synthetic)."


def test_a_gguf_gives_its_shape_as_a_checkpoint_folder_does(tmp_path):
    """`--ckpt` takes the GGUF llama.cpp reads too: experts, layers and width from its metadata."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(6)
    writer.add_expert_count(16)
    writer.add_embedding_length(64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_experts": 16, "num_hidden_layers": 6, "hidden_size": 64}))
    assert ep.shape_of(str(path)) == ep.shape_of(str(folder)) == dict(num_experts=16, num_hidden_layers=6,
                                                                       hidden_size=64)
