"""Continuous batching behind the server: invisible in the answers, bounded, cancellable, and clean
after a storm of streaming clients; plus keys, the loading window and the CLI's lifecycle."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from conftest import Server, wait_until
from moestream.serve.app import ServeOptions, create_app

PROMPTS = [[7, 8, 9] + list(range(200 + 11 * i, 230 + 13 * i)) for i in range(6)]


def complete(url: str, prompt: list[int], max_tokens: int) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    r = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text


def test_concurrent_greedy_requests_equal_each_alone(server, demo_engine):
    alone = [complete(server.url, p, 6 + 2 * i) for i, p in enumerate(PROMPTS)]
    demo_engine.clear_prefix_cache()
    seen_running = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen_running.append(server.state.worker.running)
            time.sleep(0.001)
    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda a: complete(server.url, *a), [(p, 6 + 2 * i) for i, p in enumerate(PROMPTS)]))
    stop.set()
    watcher.join()
    assert together == alone
    assert max(seen_running) > 1                    # they really ran in one batch


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _stream_one(client: openai.OpenAI, i: int) -> tuple[str, str]:
    text, finish = "", None
    for chunk in client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"story {i}"}],
                                                max_tokens=4 + i % 5, temperature=0.7, seed=i, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_64_streaming_clients_all_complete_and_leave_nothing_behind(server, demo_engine):
    def storm():   # one client object a storm (a client takes 35 ms to make), 64 connections of it at once
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as client, \
                ThreadPoolExecutor(64) as pool:
            return list(pool.map(lambda i: _stream_one(client, i), range(64)))
    first = storm()
    assert all(finish in ("stop", "length") for _, finish in first)
    rss = _rss_bytes()
    second = storm()
    assert all(finish in ("stop", "length") for _, finish in second)
    wait_until(lambda: server.state.worker.running == 0 and server.state.worker.waiting == 0)
    assert demo_engine.scheduler.idle and not server.state.worker._active
    assert demo_engine.runner.cache.rows <= demo_engine.scheduler.max_batch        # rows never beyond the batch
    assert demo_engine.blocks.used == 0                                             # every KV block given back
    assert demo_engine.blocks.available == demo_engine.blocks.capacity
    assert _rss_bytes() - rss < 256 * 2**20                                         # no growth per round


def test_a_client_that_disconnects_is_cancelled(server):
    with httpx.stream("POST", f"{server.url}/v1/completions",
                      json={"model": "m", "prompt": "Long ago", "max_tokens": 300, "stream": True,
                            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data:"):
                break
        wait_until(lambda: server.state.worker.running == 1)
    # Closed after the first event: the sequence leaves the batch instead of generating 300 tokens.
    wait_until(lambda: server.state.worker.running == 0, timeout=30)
    assert server.state.engine.scheduler.idle


def test_a_full_queue_answers_429_with_retry_after(demo_engine):
    srv = Server(create_app(lambda: demo_engine, ServeOptions(model_name="demo", max_queue=1)), demo_engine)
    try:
        srv.wait_ready()
        worker = srv.state.worker
        worker._queued = 5                                    # as if five requests were waiting
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "busy" in r.json()["error"]["message"] and r.json()["error"]["type"] == "rate_limit_error"
        worker._queued = 0
        assert httpx.post(f"{srv.url}/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 2}).status_code == 200
    finally:
        srv.stop()


def test_api_key_is_required_where_set(demo_engine):
    srv = Server(create_app(lambda: demo_engine, ServeOptions(model_name="demo", api_key="s3cret")), demo_engine)
    try:
        srv.wait_ready()
        body = {"model": "m", "prompt": "a", "max_tokens": 1}
        assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 401
        wrong = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        anth = httpx.post(f"{srv.url}/v1/messages", json=body, headers={"x-api-key": "nope"})
        assert anth.status_code == 401 and anth.json()["error"]["type"] == "authentication_error"
        ok = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(**body).usage.completion_tokens == 1
        assert httpx.post(f"{srv.url}/v1/completions", json=body, headers={"x-api-key": "s3cret"}).status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200          # health needs no key
    finally:
        srv.stop()


def test_the_server_answers_503_while_loading(demo_engine):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return demo_engine
    srv = Server(create_app(slow_load, ServeOptions()), demo_engine)
    try:
        r = httpx.get(f"{srv.url}/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        release.set()
        srv.wait_ready()
    finally:
        release.set()
        srv.stop()


def test_serve_cli_starts_answers_and_exits_0_on_sigterm(tmp_path):
    port_probe = __import__("socket").socket()
    port_probe.bind(("127.0.0.1", 0))
    port = port_probe.getsockname()[1]
    port_probe.close()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>")
    proc = subprocess.Popen([sys.executable, "-m", "moestream", "serve", "--device", "cpu", "--port", str(port),
                             "--max-context", "256", "--warmup-tokens", "2", "--max-tokens", "2",
                             "--chat-template", str(template), "--keepalive", "5"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health").status_code == 200
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stderr.read()
                return False
        wait_until(healthy, timeout=120)
        r = httpx.post(f"{url}/v1/completions", json={"model": "x", "prompt": "The fox", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == "demo_model"
        assert r.json()["usage"]["completion_tokens"] == 2          # --max-tokens is the ceiling
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "x", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2   # --chat-template serves chat
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "serving demo_model on" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_cli_refuses_a_bad_checkpoint_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "moestream", "serve", str(tmp_path / "missing"), "--port", "0"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("moestream: error:")


def test_a_checkpoint_without_tokenizer_serves_token_id_completions(tiny_qwen3):
    import moestream

    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    assert engine.tokenizer is None
    srv = Server(create_app(lambda: engine, ServeOptions()), engine)
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="m", prompt=[5, 6, 7, 8], max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == 4
        chunks = [c for c in client.completions.create(model="m", prompt=[5, 6, 7, 8], max_tokens=5, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True}) if c.choices]
        assert len(chunks) == 5 + 1                           # one per token, then the finish
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="token ids"):
            client.completions.create(model="m", prompt="text")
    finally:
        srv.stop()
