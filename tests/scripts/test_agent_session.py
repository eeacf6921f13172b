"""benchmarks/agent_session.py: a coding agent's session, turn by turn. Smoke runs on the CPU: our
server on the demo model (its prefix cache hit on every later turn), and the llama-server client
path against a stand-in that speaks llama-server's `/completion` stream."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from fork_server import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "agent_session.py"
DEMO = ROOT / "moestream" / "demo_model"

# llama-server's interface as the benchmark uses it: -np slots, /health, a streamed /completion of
# token ids that returns the generated ids (`return_tokens`) and the reused prompt (`timings.cache_n`).
FAKE_LLAMA_SERVER = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
opt = lambda name: argv[argv.index(name) + 1]
slots = [[] for _ in range(int(opt("-np")))]
log = open(opt("-m") + ".requests", "a")

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/completion" and body["return_tokens"] and body["cache_prompt"] and body["stream"]
        prompt, slot = body["prompt"], body["id_slot"]
        cached = 0
        while cached < min(len(prompt), len(slots[slot])) and prompt[cached] == slots[slot][cached]:
            cached += 1
        out = [(sum(prompt) + i) % 1000 + 1 for i in range(body["n_predict"])]
        slots[slot] = prompt + out
        log.write(json.dumps({"slot": slot, "prompt": prompt, "tokens": out, "ctx": int(opt("-c"))}) + "\n"); log.flush()
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        chunks = [{"content": "x", "tokens": [t], "stop": False} for t in out]
        chunks.append({"content": "", "tokens": [], "stop": True, "timings": {"cache_n": cached, "prompt_n": len(prompt) - cached}})
        for c in chunks:
            self.wfile.write(f"data: {json.dumps(c)}\n\n".encode()); self.wfile.flush()
        self.close_connection = True

ThreadingHTTPServer(("127.0.0.1", int(opt("--port"))), Handler).serve_forever()
'''


def _run(out: Path, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = run_script(SCRIPT, "--ckpt", str(DEMO), "--no-write", "--out", str(out), "--tiny",
                     *extra, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert (out / "agent_session.md").exists()
    return json.loads((out / "agent_session.json").read_text())


def _check_conversations(runs: list[dict], sessions: list[int], turns: int, new: int, gen: int, first: int) -> None:
    assert [r["sessions"] for r in runs] == sessions
    for run in runs:
        assert len(run["per_session"]) == run["sessions"] and run["wall_s"] > 0
        for s in run["per_session"]:
            assert s["replies"] == "the server's own tokens" and s["wall_s"] > 0
            assert len(s["turns"]) == turns and len(s["turns"][0]["prompt_ids"]) == first
            for t in s["turns"]:
                assert t["generated"] == gen == len(t["generated_ids"])
                assert t["ttft_ms"] > 0 and t["decode_tok_s"] > 0 and t["turn_ms"] >= t["ttft_ms"]
                assert t["prompt_tokens"] == len(t["prompt_ids"])
            for before, turn in zip(s["turns"], s["turns"][1:]):   # the conversation grows as an agent's does
                grown = before["prompt_ids"] + before["generated_ids"]
                assert turn["prompt_ids"][:len(grown)] == grown and len(turn["prompt_ids"]) == len(grown) + new
                assert turn["cached_tokens"] > 0                      # the prefix cache was hit
    firsts = [s["turns"][0]["prompt_ids"] for r in runs for s in r["per_session"]]
    assert len({tuple(p) for p in firsts}) == len(firsts)             # every session its own conversation


def test_our_server_runs_every_turn_of_every_session_on_its_cached_conversation(tmp_path):
    result = _run(tmp_path)
    _check_conversations(result["ours"]["runs"], [1, 2], turns=3, new=6, gen=5, first=40)
    for s in (s for r in result["ours"]["runs"] for s in r["per_session"]):
        assert s["turns"][0]["cached_tokens"] == 0                    # the first turn was sent by nobody before
        assert all(t["kernels_compiled"] == 0 for t in s["turns"])    # read from /metrics; the CPU compiles none
    assert result["routing"] == "uniform" and result["machine"]["cores"] >= 1 and "ours" in result["commands"]
    assert result["turn_shape"]["context_per_session"] >= 40 + 2 * 6 + 3 * 5
    rows = result["headline"]
    assert len(rows) == 8 and all(r["ours"] is not None and r["llama_server"] is None for r in rows)
    table = (tmp_path / "agent_session.md").read_text()
    assert table.count("| not run |") == 8 and "first-turn TTFT, 2 sessions" in table


def test_llama_server_gets_the_same_sessions_on_pinned_slots_with_its_token_ids(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\n{FAKE_LLAMA_SERVER}")
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    result = _run(tmp_path / "out", "--peer-only", "--llama-server", str(fake), "--gguf", str(gguf), "--sessions", "2",
                  "--warm-turns", "0")
    _check_conversations(result["llama_server"]["runs"], [2], turns=3, new=6, gen=5, first=40)
    requests = [json.loads(line) for line in (tmp_path / "m.gguf.requests").read_text().splitlines()]
    assert sorted(r["slot"] for r in requests) == [0, 0, 0, 1, 1, 1]   # session i stays on slot i
    assert {r["ctx"] for r in requests} == {2 * result["turn_shape"]["context_per_session"]}
    assert all(r["llama_server"] is not None and r["ours"] is None for r in result["headline"])
    assert "not run (--peer-only)" in (tmp_path / "out" / "agent_session.md").read_text()
