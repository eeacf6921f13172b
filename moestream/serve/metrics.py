"""Prometheus metrics of one server (its own registry, so several servers in one process stay apart).

Request counts by API and status, tokens in / out / reused, time to first token and between
tokens, each engine step's wall time (prompt steps and decode steps apart: a stall shows as a step
of seconds), queue depth and running sequences (sampled after every step), and the state of the
prefix cache and the expert bank, read when `/metrics` is scraped; with several devices, each
rank's bank and all-reduces (calls, bytes, seconds) labelled by rank. And the Triton kernel variants
compiled in the process: after the start's warm-up a served step should compile none (ARCHITECTURE.md,
rules of the hot path), so a count that grows while serving marks a step that stalled to compile.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from moestream.kernels import compiled_variants

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)
# An agent's first turn on an offloaded model prefills tens of thousands of tokens: minutes, up to
# the half hour after which agents give up anyway.
_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 900, 1200, 1800)
# A step: a decode step in milliseconds, a prompt chunk's in tenths of a second; seconds mean a stall.
_STEP_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class ServerMetrics:
    def __init__(self, engine):
        self.engine = engine
        self.worker = None   # set once the worker exists: the queue gauges are read from it at scrape time too
        self.registry = r = CollectorRegistry()
        self.requests = Counter("moestream_requests", "Requests answered, by API and HTTP status", ["api", "status"],
                                registry=r)
        self.prompt_tokens = Counter("moestream_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_tokens = Counter("moestream_prompt_cached_tokens",
                                     "Prompt tokens restored from the prefix cache instead of prefilled", registry=r)
        self.generated_tokens = Counter("moestream_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("moestream_time_to_first_token_seconds", "Submit to first token", registry=r,
                              buckets=_TTFT_BUCKETS)
        self.itl = Histogram("moestream_inter_token_seconds", "Time between a sequence's tokens", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.step_seconds = Histogram("moestream_step_seconds", "Wall time of one engine step, as the server's worker "
                                      "runs it: steps with prompt chunks, and steps of decodes alone", ["kind"],
                                      registry=r, buckets=_STEP_BUCKETS)
        self.queue_depth = Gauge("moestream_queue_depth", "Requests waiting for a place in the batch", registry=r)
        self.running = Gauge("moestream_running_sequences", "Sequences in the decode batch", registry=r)
        self.kv_rows = Gauge("moestream_kv_cache_rows", "Sequence rows the KV cache holds (each a full context, or "
                             "with a paged cache a row of block ids)", registry=r)
        self.kv_blocks = Gauge("moestream_kv_cache_blocks", "Blocks of a paged KV cache", registry=r)
        self.kv_blocks_used = Gauge("moestream_kv_cache_blocks_used", "Blocks held by running sequences", registry=r)
        self.kv_blocks_cached = Gauge("moestream_kv_cache_blocks_cached",
                                      "Blocks no sequence holds, kept as the prefix cache", registry=r)
        self.kv_rows_used = Gauge("moestream_kv_cache_rows_used", "Rows held by running sequences", registry=r)
        self.prefix_bytes = Gauge("moestream_prefix_cache_bytes", "Device bytes held by the prefix cache", registry=r)
        self.prefix_hit_rate = Gauge("moestream_prefix_cache_hit_rate", "Lookups that reused a prefix", registry=r)
        self.prefix_token_reuse = Gauge("moestream_prefix_cache_token_reuse",
                                        "Share of prompt tokens restored instead of prefilled", registry=r)
        self.bank_hit_rate = Gauge("moestream_bank_hit_rate", "Expert lookups served by the bank", registry=r)
        self.kernel_variants = Gauge("moestream_kernel_variants_compiled",
                                     "Triton kernel variants compiled in this process (growing while serving: a step "
                                     "that stalled to compile)", registry=r)
        self.bank_bytes_copied = Gauge("moestream_bank_bytes_copied", "Expert bytes copied into the bank", registry=r)
        # Expert parallel: each rank's own bank and all-reduces (absent with one device).
        self.rank_hit_rate = Gauge("moestream_rank_bank_hit_rate", "Expert lookups served by this rank's bank",
                                   ["rank", "device"], registry=r)
        self.rank_bytes_copied = Gauge("moestream_rank_bank_bytes_copied", "Expert bytes copied into this rank's bank",
                                       ["rank", "device"], registry=r)
        self.rank_collective_calls = Gauge("moestream_rank_allreduce_calls",
                                           "All-reduces of the MoE layers' partial outputs run by this rank",
                                           ["rank", "device"], registry=r)
        self.rank_collective_bytes = Gauge("moestream_rank_allreduce_bytes", "Bytes this rank's all-reduces reduced",
                                           ["rank", "device"], registry=r)
        self.rank_collective_seconds = Gauge("moestream_rank_allreduce_seconds",
                                             "Time in this rank's all-reduces (those replayed in CUDA graphs untimed)",
                                             ["rank", "device"], registry=r)

    # ---- called by the worker thread ------------------------------------------------------
    def first_token(self, request) -> None:
        self.ttft.observe(request.first_token - request.submitted)
        self.prompt_tokens.inc(len(request.seq.prompt))
        self.cached_tokens.inc(request.seq.cached_tokens)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def step(self, seconds: float, prompt: bool) -> None:
        """One engine step's wall time; `prompt`: it ran prompt chunks (decodes may have ridden in them)."""
        self.step_seconds.labels("prompt" if prompt else "decode").observe(seconds)

    def after_step(self, worker) -> None:
        self._gauge_queue(worker)
        cache = self.engine.runner.cache
        self.kv_rows.set(cache.rows if cache is not None else 0)
        blocks = self.engine.blocks
        if blocks is not None:
            self.kv_blocks.set(blocks.capacity)
            self.kv_blocks_used.set(blocks.used)
            self.kv_blocks_cached.set(len(blocks.cached))

    def _gauge_queue(self, worker) -> None:
        self.queue_depth.set(worker.waiting)
        self.running.set(worker.running)
        self.kv_rows_used.set(worker.running)

    # ---- called by handlers ---------------------------------------------------------------
    def answered(self, api: str, status: int, generated: int = 0) -> None:
        self.requests.labels(api, str(status)).inc()
        if generated:
            self.generated_tokens.inc(generated)

    def refresh_engine(self) -> None:
        """Read the prefix cache's and the bank's figures (they wait for the step in progress)."""
        stats = self.engine.prefix_cache_stats()
        if stats is not None:
            self.prefix_bytes.set(stats["used_bytes"])
            self.prefix_hit_rate.set(stats["hit_rate"])
            self.prefix_token_reuse.set(stats["token_reuse"])
        self.kernel_variants.set(sum(compiled_variants().values()))
        bank = self.engine.stats()
        self.bank_hit_rate.set(bank["hit_rate"])
        self.bank_bytes_copied.set(bank["bytes_copied"])
        for rank, figures in enumerate(bank.get("ranks", ())):
            labels = (str(rank), figures.get("device", ""))
            collective = figures.get("collective", {})
            self.rank_hit_rate.labels(*labels).set(figures["hit_rate"])
            self.rank_bytes_copied.labels(*labels).set(figures["bytes_copied"])
            self.rank_collective_calls.labels(*labels).set(collective.get("calls", 0))
            self.rank_collective_bytes.labels(*labels).set(collective.get("bytes", 0))
            self.rank_collective_seconds.labels(*labels).set(collective.get("seconds", 0.0))

    def render(self, refresh: bool = True) -> bytes:
        """The exposition text; `refresh=False` when the engine's figures were read already (or are
        being waited for: the server does not hold a scrape behind a long step)."""
        if refresh:
            self.refresh_engine()
        if self.worker is not None:   # live even while one long step (a long prefill) holds the worker
            self._gauge_queue(self.worker)
        return generate_latest(self.registry)
