"""A real server on loopback, serving the bundled demo model (fp32 on the CPU), for the API tests.

`force` is the test-only sampling hook: it makes the model emit a chosen text for every request
whose prompt contains a marker, so tool-call round trips can be driven through a real model."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

import moestream
from moestream.cli import DEMO_MODEL
from moestream.engine.engine import Engine
from moestream.serve.app import ServeOptions, create_app

MAX_CONTEXT = 384


class Server:
    def __init__(self, app, engine=None):
        self.app, self.engine = app, engine
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.05)

    @property
    def state(self):
        return self.app.state.status["state"]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def load_demo(**kw) -> Engine:
    return moestream.load(str(DEMO_MODEL), device="cpu", dtype="float32", max_context=MAX_CONTEXT, max_batch=8,
                          prefix_cache_memory="64MiB", **kw)


@pytest.fixture(scope="session")
def demo_engine():
    return load_demo()


@pytest.fixture(scope="session")
def server(demo_engine):
    srv = Server(create_app(lambda: demo_engine, ServeOptions(model_name="demo")), demo_engine)
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture
def force(demo_engine, monkeypatch):
    """force(marker, text): requests whose prompt contains `marker` generate exactly `text`, then end."""
    scripts: dict[str, list[int]] = {}
    per_seq: dict[int, list[int] | None] = {}
    tokenizer = demo_engine.tokenizer
    sample = Engine._sample

    def forced_sample(self, seqs, logits):
        logits = logits.clone()
        for row, seq in enumerate(seqs):
            if seq.id not in per_seq:
                prompt = tokenizer.decode(seq.prompt)
                per_seq[seq.id] = next((ids for marker, ids in scripts.items() if marker in prompt), None)
            script = per_seq[seq.id]
            if script is not None:
                want = script[seq.sampled] if seq.sampled < len(script) else min(self.eos_ids)
                logits[row] = -1e4
                logits[row, want] = 1e4
        return sample(self, seqs, logits)

    monkeypatch.setattr(Engine, "_sample", forced_sample)

    def add(marker: str, text: str) -> None:
        scripts[marker] = tokenizer(text, add_special_tokens=False).input_ids
    return add


def wait_until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
