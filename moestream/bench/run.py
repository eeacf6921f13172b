"""`moestream bench`: time to first token, prefill and decode speed, hit rate and bytes moved per token.

Prompts are seeded random token ids (so any checkpoint works, tokenizer or not); the bank's
counters are split at the first token, so decode figures exclude the prompt's streaming.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import asdict, dataclass

import torch

from moestream.bench.routing import TraceRouting, UniformRouting
from moestream.engine import Engine
from moestream.sizes import format_bytes


@dataclass
class BenchResult:
    device: str
    dtype: str
    capacity: int
    num_experts: int
    miss_policy: str
    host_tier: str
    prompt_tokens: int
    gen_tokens: int
    temperature: float
    load_s: float
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    decode_hit_rate: float
    decode_bytes_per_token: float
    decode_cpu_bytes_per_token: float   # expert bytes the CPU read from host RAM per token (hybrid misses)
    decode_cpu_share: float             # share of the decode misses the CPU computed
    decode_host_read_bytes_per_token: float   # expert bytes the GPU read in place from host RAM per token (hybrid)
    decode_cpu_busy_s_per_token: float  # time the CPU spent computing missed experts per token (its share of the
                                        # token: × decode_tok_s), the worker's rate: cpu bytes ÷ this
    prefill_bytes: float
    peak_device_bytes: int
    budget_bytes: int | None
    graph_pool_bytes: int
    routing: str

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        routing = ("the model's router" if self.routing == "model"
                   else f"{self.routing}: experts chosen by the benchmark, not the model")
        rows = [("routing", routing),
                ("capacity", f"{self.capacity}/{self.num_experts} ({self.miss_policy}, host tier {self.host_tier})"),
                ("load", f"{self.load_s:.2f} s"),
                ("time to first token", f"{self.ttft_s * 1000:.1f} ms ({self.prompt_tokens} prompt tokens)"),
                ("prefill", f"{self.prefill_tok_s:.1f} tok/s"),
                ("decode", f"{self.decode_tok_s:.2f} tok/s ({self.gen_tokens} tokens)"),
                ("decode hit rate", f"{self.decode_hit_rate:.1%}"),
                ("moved per token", f"{self.decode_bytes_per_token / 1e9:.3f} GB copied, "
                                    f"{self.decode_cpu_bytes_per_token / 1e9:.3f} GB read by the CPU "
                                    f"({self.decode_cpu_share:.0%} of the misses), "
                                    f"{self.decode_host_read_bytes_per_token / 1e9:.3f} GB read in place by the device"),
                ("CPU busy per token", f"{self.decode_cpu_busy_s_per_token * 1000:.2f} ms "
                                       f"({self.decode_cpu_busy_s_per_token * self.decode_tok_s:.0%} of the token)"),
                ("peak device memory", format_bytes(self.peak_device_bytes)
                 + (f" (budget {format_bytes(self.budget_bytes)})" if self.budget_bytes else ""))]
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)


def run_bench(engine: Engine, prompt_tokens: int, gen_tokens: int, load_s: float = 0.0, seed: int = 0,
              warmup_tokens: int = 4, temperature: float = 0.0,
              routing: UniformRouting | TraceRouting | None = None, prompt_repeats: int = 3) -> BenchResult:
    """`routing`: the benchmark routing swapped in with `use_routing` (None: the model's own); a
    replayed trace restarts at its first token for the timed run.

    The time to first token is the median over `prompt_repeats` fresh prompts of the same length (no
    prefix shared, so none is cached) and the timed run's own: one prompt alone varies several-fold
    from run to run on a GPU (4.6 to 53 ms for the same 512-token prefill, measured), as llama-bench's
    repetitions show for its own figures.

    temperature > 0 samples (seeded): random-weight models then decode diverse tokens instead of
    repeating one, so their routing stays near-uniform (greedy decoding of random weights tends to
    settle on one token and route it to the same experts every step, a best case for the bank)."""
    vocab = engine.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist()
    warm = torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist()
    # same prompt length: prefill kernels compile outside the timing; decode graphs captured ahead
    engine.generate(warm, max_tokens=warmup_tokens, ignore_eos=True)
    ttfts = []
    for _ in range(prompt_repeats):   # prompts alone: their first token only
        engine.generate(torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist(), max_tokens=1,
                        ignore_eos=True)
        ttfts.append(engine.last_metrics.ttft_s)
    before_graphs = torch.cuda.memory_allocated(engine.device) if engine.device.type == "cuda" else 0
    engine.runner.prepare(1, prompt_tokens + gen_tokens, prompt_tokens)
    graph_bytes = (torch.cuda.memory_allocated(engine.device) - before_graphs) if engine.device.type == "cuda" else 0
    engine.reset_stats()
    if routing is not None:
        engine.runner.reset_routing()   # every rank of a group starts its draws or replay again
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)   # peak memory stays process-wide: loading counts too
    first_stats = None
    for i, _ in enumerate(engine.stream_tokens(prompt, max_tokens=gen_tokens, ignore_eos=True,
                                               temperature=temperature, seed=seed)):
        if i == 0:
            engine.bank.sync_stats()
            first_stats = copy.deepcopy(engine.bank.stats)
    m = engine.last_metrics
    ttft = statistics.median(ttfts + [m.ttft_s])
    engine.bank.sync_stats()
    total = engine.bank.stats.total()
    at_first = first_stats.total()
    decode_pairs = (total.hits - at_first.hits) + (total.misses - at_first.misses)
    decode_steps = max(1, m.generated_tokens - 1)
    peak = torch.cuda.max_memory_allocated(engine.device) if engine.device.type == "cuda" else m.peak_memory_bytes
    plan = engine.plan.memory
    return BenchResult(
        device=str(engine.device), dtype=str(engine.dtype).replace("torch.", ""), capacity=engine.bank.capacity,
        num_experts=engine.config.num_experts, miss_policy=engine.bank.miss_policy,
        host_tier=engine.bank.tier.name if engine.bank.tier is not None else "none",
        prompt_tokens=prompt_tokens, gen_tokens=m.generated_tokens, temperature=temperature, load_s=load_s, ttft_s=ttft,
        prefill_tok_s=prompt_tokens / ttft if ttft else 0.0, decode_tok_s=m.decode_tok_s,
        decode_hit_rate=(total.hits - at_first.hits) / decode_pairs if decode_pairs else 1.0,
        decode_bytes_per_token=(total.bytes_copied - at_first.bytes_copied) / decode_steps,
        decode_cpu_bytes_per_token=(total.cpu_bytes - at_first.cpu_bytes) / decode_steps,
        decode_cpu_share=((total.cpu_served - at_first.cpu_served) / max(1, total.misses - at_first.misses)),
        decode_host_read_bytes_per_token=(total.host_read_bytes - at_first.host_read_bytes) / decode_steps,
        decode_cpu_busy_s_per_token=(total.cpu_s - at_first.cpu_s) / decode_steps,
        prefill_bytes=float(at_first.bytes_copied), peak_device_bytes=int(peak), budget_bytes=plan.budget,
        graph_pool_bytes=int(graph_bytes),
        routing="model" if routing is None else routing.label)
