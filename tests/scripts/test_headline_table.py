"""benchmarks/headline_table.py: the smoke path end to end on the CPU (a tiny random checkpoint, its int4
forms, every row of ours, no llama.cpp), and the table's ratios and failed rows from made-up runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from fork_server import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "headline_table.py"


def _module():
    spec = importlib.util.spec_from_file_location("headline_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


def _table_rows(markdown: str) -> list[list[str]]:
    lines = [ln for ln in markdown.splitlines() if ln.startswith("| ") and not ln.startswith("| # ")]
    return [[cell.strip() for cell in ln.strip("|").split("|")] for ln in lines]


def test_a_gguf_format_alone_gets_its_gguf_from_the_shape(tmp_path):
    """No random checkpoint is asked for: the GGUF is still written (from the shape's config) and read."""
    out = tmp_path / "table"
    run = run_script(SCRIPT, "--out", str(out), "--tiny", "--cpu", "--formats", "gguf-q8_0",
                     "--no-served", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    table = json.loads((out / "headline_table.json").read_text())
    resident = table["runs"]["ours-gguf-q8_0-resident"]
    assert resident["error"] is None and resident["result"]["decode_tok_s"] > 0, resident
    assert not list((out / "work").glob("ckpt-*"))   # no checkpoint written for it


def test_the_smoke_run_writes_one_table_with_every_row_and_no_peer(tmp_path):
    out = tmp_path / "table"
    run = run_script(SCRIPT, "--out", str(out), "--tiny", "--cpu", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    table = json.loads((out / "headline_table.json").read_text())
    markdown = (out / "headline_table.md").read_text()
    assert markdown in run.stdout                                  # printed and written alike
    assert sorted(p.name for p in out.iterdir()) == ["headline_table.json", "headline_table.md", "work"]  # no temporaries

    rows = table["rows"]
    formats = ["bf16 / BF16", "int4 experts / Q4_0", "int4 everywhere / Q4_0", "fp8 block / Q8_0",
               "llama.cpp's Q8_0 GGUF / Q8_0", "llama.cpp's Q4_0 GGUF / Q4_0"]
    bench_rows = [r for r in rows if not r["row"].startswith(("served", "agent"))]
    traced = formats[:3]                                           # FP8 and GGUF banks fetch: no trace row
    assert [r["format"] for r in bench_rows] == formats * 3 + traced + formats
    names = [r["row"] for r in rows]
    assert names[0] == "resident decode, batch 1" and "resident prompt" in names
    assert sum("25% bank" in n and n.endswith("decode") for n in names) == 9
    gguf_run = table["runs"]["ours-gguf-q4_0-resident"]["command"]  # our engine on llama.cpp's own file
    assert "peer-q4_0.gguf" in gguf_run and gguf_run.startswith("python -m moestream bench")
    assert {r["routing"] for r in bench_rows if "bank" in r["row"] and r["row"].endswith("decode")} == {
        "uniform (synthetic)", "trace replay (random_trace_16x8.json)"}
    bank = f"25% bank (llama.cpp --n-cpu-moe {table['n_cpu_moe']} of 2)"
    assert [n for n in names if n.startswith("served")] == ["served, 1 stream (aggregate decode)",
                                                            "served, 4 streams (aggregate decode)",
                                                            f"served at a {bank}, 2 streams (aggregate decode)"]
    assert "--capacity 8" in table["runs"]["served-ours-bank"]["command"]
    served = table["runs"]["served-ours-bank"]["result"]["streams"][0]
    assert served["steps"]["prompt"]["count"] >= 1 and served["steps"]["decode"]["count"] >= 1   # our server's steps
    assert [r["unit"] for r in rows if r["row"].startswith("agent")] == ["ms", "ms"]
    for r in rows:   # every row of ours measured; no peer, so no llama.cpp figure and no ratio
        assert r["ours"] is not None and r["ours"] > 0, r
        assert r["llama_cpp"] is None and r["ratio"] is None and r["llama_cpp_note"].startswith("not run"), r
        assert r["commands"] and all(key in table["runs"] for key in r["commands"])
    assert table["capacity"] == 8                                  # 25% of the tiny shape's 16 experts is under its top-8
    assert table["date"] and table["machine"]["cpu"] and table["machine"]["gpu"]
    assert "--tiny --cpu" in table["command"]

    md_rows = _table_rows(markdown)
    assert len(md_rows) == len(rows)
    for cells, r in zip(md_rows, rows):
        number, name, fmt, routing, ours, peer, ratio, runs = cells
        assert (name, fmt, routing) == (r["row"], r["format"], r["routing"])
        assert peer == "not run" and ratio == ""
    assert "llama.cpp not run: no llama.cpp given" in markdown
    assert "python -m moestream bench" in markdown                 # the commands that made the rows


def test_rows_take_same_machine_ratios_and_say_why_a_cell_is_empty():
    m = _module()
    Run = m.Run
    ours = {}
    for fmt in ("bf16", "int4-experts", "int4-everywhere"):
        for kind in ("resident", "bank-uniform", "bank-trace"):
            ours[f"ours-{fmt}-{kind}"] = Run(f"ours-{fmt}-{kind}", ["x"], result={"decode_tok_s": 100.0, "prefill_tok_s": 1000.0})
    ours["ours-int4-experts-bank-uniform"] = Run("ours-int4-experts-bank-uniform", ["x"], error="exit 1: out of memory")
    peer = {"llama-bf16-resident": Run("llama-bf16-resident", ["y"], result={"decode_tok_s": 50.0, "prompt_tok_s": 4000.0}),
            "llama-bf16-bank": Run("llama-bf16-bank", ["y"], error="failed: timed out after 1200 s"),
            "llama-q4_0-resident": Run("llama-q4_0-resident", ["y"], result={"decode_tok_s": 200.0, "prompt_tok_s": 500.0}),
            "llama-q4_0-bank": Run("llama-q4_0-bank", ["y"], result={"decode_tok_s": 80.0, "prompt_tok_s": 2000.0})}
    served = {"served-ours": Run("served-ours", ["z"], result={
                  "streams": [{"streams": 1, "aggregate_decode_tok_s": 300.0}, {"streams": 16, "aggregate_decode_tok_s": 1200.0}],
                  "second_turn": {"ttft_cached_ms": 40.0, "ttft_cold_ms": 600.0}}),
              "served-llama": Run("served-llama", ["w"], result={
                  "streams": [{"streams": 1, "aggregate_decode_tok_s": 330.0}, {"streams": 16, "aggregate_decode_tok_s": 960.0}],
                  "second_turn": {"ttft_cached_ms": 48.0, "ttft_cold_ms": 1200.0}})}
    rows = {(r.row, r.format, r.routing): r for r in m.make_rows(ours, peer, served, "trace replay (demo model)", 18, 24, [1, 16])}
    bank = "25% bank (llama.cpp --n-cpu-moe 18 of 24)"
    resident = rows[("resident decode, batch 1", "bf16 / BF16", m.UNIFORM)]
    assert (resident.ours, resident.llama_cpp, resident.ratio) == (100.0, 50.0, 2.0)
    assert rows[("resident prompt", "bf16 / BF16", m.UNIFORM)].ratio == 0.25
    q4 = rows[(f"{bank} decode", "int4 everywhere / Q4_0", "trace replay (demo model)")]
    assert q4.llama_cpp == 80.0 and q4.ratio == 1.25                # one llama.cpp run serves both routing rows
    failed_ours = rows[(f"{bank} decode", "int4 experts / Q4_0", m.UNIFORM)]
    assert failed_ours.ours is None and failed_ours.ratio is None and "out of memory" in failed_ours.ours_note
    failed_peer = rows[(f"{bank} decode", "bf16 / BF16", m.UNIFORM)]
    assert failed_peer.ours == 100.0 and failed_peer.ratio is None and "timed out" in failed_peer.llama_cpp_note
    assert rows[("served, 16 streams (aggregate decode)", "bf16 / BF16", m.UNIFORM)].ratio == 1.25
    cached = rows[("agent's second turn, prefix cached (time to first token)", "bf16 / BF16", m.UNIFORM)]
    assert cached.unit == "ms" and cached.ratio == 1.2              # ms: theirs ÷ ours, so above 1 is faster too
    table = {"date": "d", "shape": "s", "command": "c", "in_process": False, "peer_missing": "",
             "machine": {"gpu": "g", "cpu": "c", "cores": 1, "memory": "", "torch": "t", "moestream_commit": "h"},
             "rows": [m.asdict(r) for r in rows.values()],
             "runs": {k: {"command": r.text, "error": r.error} for k, r in {**ours, **peer, **served}.items()}}
    text = m.markdown(table)
    assert "| **2.00×** |" in text and "exit 1: out of memory" in text and "failed: timed out after 1200 s" in text


FAKE_LLAMA_BENCH = """#!/bin/sh
case "$*" in *q4_0*) echo "llama_model_load: error loading model: tensor data is not within the file bounds" >&2; exit 1;; esac
case "$*" in *"--n-cpu-moe 18"*) tg=20.5;; *) tg=50.25;; esac
echo "load_tensors: [ 1/3 ] loading" >&2
printf '[\\n  {"n_prompt": 512, "n_gen": 0, "avg_ts": 4000.0, "stddev_ts": 1.0},\\n'
echo "llama_context: n_ctx = 4096 [\\n" >&2
printf '  {"n_prompt": 0, "n_gen": 64, "avg_ts": %s, "stddev_ts": 0.5}\\n]\\n' "$tg"
"""


def test_llama_bench_figures_are_read_per_setting_and_a_failing_peer_is_reported(tmp_path):
    """llama-bench writes its JSON to stdout while its loading messages go to stderr between two tests:
    each setting's prompt and decode figures are read from stdout alone; a run that fails says why."""
    m = _module()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "llama-bench").write_text(FAKE_LLAMA_BENCH)
    (bin_dir / "llama-bench").chmod(0o755)
    ggufs = {q: tmp_path / f"peer-{q}.gguf" for q in ("bf16", "q4_0")}
    args = m.argparse.Namespace(prompt_tokens=512, gen_tokens=64, repetitions=1, n_cpu_moe=18, cpu=False, timeout_run=60)
    runs = m.peer_runs(args, m.Runner(tmp_path / "logs", in_process=False), bin_dir, ggufs, "")
    assert runs["llama-bf16-resident"].error is None
    assert (runs["llama-bf16-resident"].result["prompt_tok_s"], runs["llama-bf16-resident"].result["decode_tok_s"]) == (4000.0, 50.25)
    assert runs["llama-bf16-bank"].result["decode_tok_s"] == 20.5
    assert "--n-cpu-moe 18" in runs["llama-bf16-bank"].text
    failed = runs["llama-q4_0-bank"]
    assert failed.result is None and failed.error.startswith("failed: exit 1") and "not within the file bounds" in failed.error
