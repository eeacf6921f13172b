#!/usr/bin/env python3
"""Peer measurement: Hugging Face transformers (+ accelerate offload) on the same checkpoint.

Why: moestream's numbers only mean something next to what a user gets from the
standard stack.  This script is deliberately independent of the moestream package.

Modes:

* ``resident``: the whole model in GPU memory (``device_map={"": 0}``), with the
  MoE experts run by ``experts_implementation`` (transformers 5.x: a
  ``from_pretrained`` keyword; default here ``grouped_mm``).
* ``offload``: accelerate big-model offload, ``device_map="auto"`` with
  ``max_memory={0: --gpu-memory, "cpu": --cpu-memory}``: layers that do not fit
  the budget stay in host RAM and are copied to the GPU at every forward.

Attention: ``--attn-impl auto`` (default) leaves the choice to transformers, sdpa where the model
has it (GPT-OSS's sinks have no sdpa form: eager); the JSON records what ran.

Measurement (on seeded random token ids, batch 1, greedy, KV cache):

* ``load_s``: ``from_pretrained`` wall time (page cache state is not controlled).
* ``ttft_s``: prefill of ``--prompt-tokens`` tokens up to the first generated token.
* ``decode_tok_s``: ``(gen_tokens - 1) / time`` of the following single-token steps
  (the first token is part of TTFT, so it is excluded).
* ``peak_alloc_gib``: ``torch.cuda.max_memory_allocated`` during the measured run
  (``load_peak_alloc_gib`` covers loading).

Decode mirrors ``model.generate``: in transformers 5.x, ``generate`` switches
``grouped_mm`` to ``batched_mm`` for the decode phase on GPU
(``_optimize_model_for_decode``).  ``--decode-experts-impl auto`` (default) does
the same; pass ``same`` to keep ``--experts-impl`` for decode too.  The JSON
records what was used.  ``--method generate`` times ``model.generate`` itself
instead of the manual loop, as a cross-check.

Examples::

    python benchmarks/hf_baseline.py /data/qwen3-24l --mode resident --json hf_resident.json
    python benchmarks/hf_baseline.py /data/qwen3-24l --mode offload --gpu-memory 16GiB --gen-tokens 4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

GIB = 2**30


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def load_model(
    model_dir: str, mode: str, device: str, experts_impl: str, gpu_memory: str, cpu_memory: str, attn_impl: str
) -> tuple[Any, dict[str, Any]]:
    """Load in bf16 per ``mode``; returns the model and facts about how it was loaded."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.bfloat16}
    if attn_impl != "auto":  # auto: transformers' own choice (sdpa where the model has it; GPT-OSS's sinks have not)
        kwargs["attn_implementation"] = attn_impl
    if mode == "resident":
        if device != "cpu":  # CPU is the default placement; skipping device_map avoids needing accelerate there
            kwargs["device_map"] = {"": device}
    else:
        if not device.startswith("cuda"):
            raise SystemExit("--mode offload needs a CUDA device")
        gpu_index = torch.device(device).index or 0
        kwargs["device_map"] = "auto"
        kwargs["max_memory"] = {gpu_index: gpu_memory, "cpu": cpu_memory}

    t0 = time.perf_counter()
    model, via = _from_pretrained_with_experts_impl(AutoModelForCausalLM, model_dir, kwargs, experts_impl)
    _sync(device)
    load_s = time.perf_counter() - t0
    model.eval()
    facts = {"load_s": load_s, "experts_impl_via": via, "experts_impl_effective": _experts_impl_of(model),
             "attn_impl_effective": getattr(model.config, "_attn_implementation", None)}
    facts.update(_placement(model))
    return model, facts


def _from_pretrained_with_experts_impl(
    auto_cls: Any, model_dir: str, kwargs: dict[str, Any], impl: str
) -> tuple[Any, str]:
    """Pass ``experts_implementation=`` (transformers >= 5); fall back to setting it after load.

    Why both: the keyword is the supported way in 5.x (checked in 5.17 and 5.23),
    but a build that does not know it may reject it, or silently store it as an
    unused config attribute; either way we still want the requested kernel rather
    than a silent default.  The returned string says which way took effect.
    """
    try:
        model = auto_cls.from_pretrained(model_dir, experts_implementation=impl, **kwargs)
        via = "from_pretrained(experts_implementation=...)"
    except TypeError as e:  # an older signature that does not know the keyword
        if "experts_implementation" not in str(e):
            raise
        print(f"[hf_baseline] from_pretrained rejected experts_implementation: {e}", file=sys.stderr)
        model = auto_cls.from_pretrained(model_dir, **kwargs)
        via = None
    if via is not None and _experts_impl_of(model) == impl:
        return model, via
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
        via = "model.set_experts_implementation(...)"
    else:
        model.config._experts_implementation = impl
        via = "config._experts_implementation"
    if _experts_impl_of(model) != impl:
        raise SystemExit(f"could not select experts implementation {impl!r} (this transformers lacks it?)")
    return model, via


def _experts_impl_of(model: Any) -> str | None:
    """The experts implementation the model will actually dispatch to."""
    return getattr(model.config, "_experts_implementation", None)


def _set_experts_impl(model: Any, impl: str) -> None:
    """Switch the experts kernel at runtime (what generate() does for decode)."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    else:
        model.config._experts_implementation = impl


def _placement(model: Any) -> dict[str, Any]:
    """Where the weights ended up: bytes per device; offloaded params sit on 'meta' behind accelerate hooks."""
    per_device: Counter[str] = Counter()
    for p in model.parameters():
        per_device[str(p.device)] += p.numel() * p.element_size()
    out: dict[str, Any] = {"weight_gib_by_device": {k: round(v / GIB, 3) for k, v in sorted(per_device.items())}}
    dm = getattr(model, "hf_device_map", None)
    if dm:
        out["device_map_modules_by_device"] = dict(Counter(str(v) for v in dm.values()))
    return out


# --------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(device: str, fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn`` and return (result, seconds), synchronizing the GPU on both sides."""
    _sync(device)
    t0 = time.perf_counter()
    r = fn()
    _sync(device)
    return r, time.perf_counter() - t0


def greedy_loop(model: Any, ids: torch.Tensor, gen_tokens: int, device: str, decode_impl: str | None) -> dict[str, Any]:
    """Prefill then single-token greedy steps with the KV cache; times each phase separately."""

    def prefill() -> tuple[torch.Tensor, Any]:
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values

    def step(tok: torch.Tensor, cache: Any) -> Callable[[], tuple[torch.Tensor, Any]]:
        def run() -> tuple[torch.Tensor, Any]:
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            return out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values

        return run

    (tok, cache), ttft = _timed(device, prefill)
    tokens, steps = [tok], []
    prefill_impl = _experts_impl_of(model)
    switch = decode_impl is not None and decode_impl != prefill_impl
    if switch:
        _set_experts_impl(model, decode_impl)
    try:
        for _ in range(gen_tokens - 1):
            (tok, cache), dt = _timed(device, step(tok, cache))
            tokens.append(tok)
            steps.append(dt)
    finally:
        if switch:
            _set_experts_impl(model, prefill_impl)
    return {
        "ttft_s": ttft,
        "decode_s": sum(steps),
        "step_s": steps,
        "tokens": torch.cat(tokens, dim=-1)[0].tolist(),
        "decode_experts_impl": decode_impl or prefill_impl,
    }


def generate_timing(model: Any, ids: torch.Tensor, gen_tokens: int, device: str) -> dict[str, Any]:
    """Cross-check with model.generate: TTFT = generate(1 token); decode rate from generate(N) - generate(1)."""

    def gen(n: int) -> torch.Tensor:
        return model.generate(
            ids,
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=model.generation_config.pad_token_id or 0,
        )

    _, t1 = _timed(device, lambda: gen(1))
    out, tn = _timed(device, lambda: gen(gen_tokens))
    return {
        "ttft_s": t1,
        "decode_s": max(tn - t1, 0.0),
        "step_s": [],
        "tokens": out[0, ids.shape[1] :].tolist(),
        "decode_experts_impl": "generate() default",
    }


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Load, warm up, measure; returns the result record."""
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available (use --device cpu only for a smoke test)")
    gen_tokens = args.gen_tokens if args.gen_tokens is not None else (4 if args.mode == "offload" else 32)
    if gen_tokens < 1:
        raise SystemExit("--gen-tokens must be >= 1")

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    model, facts = load_model(
        args.model_dir, args.mode, device, args.experts_impl, args.gpu_memory, args.cpu_memory, args.attn_impl
    )
    load_peak = torch.cuda.max_memory_allocated() / GIB if device.startswith("cuda") else None
    print(
        f"[hf_baseline] loaded in {facts['load_s']:.1f} s; experts implementation "
        f"{facts['experts_impl_effective']} via {facts['experts_impl_via']}; weights {facts['weight_gib_by_device']}",
        flush=True,
    )

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (1, args.prompt_tokens), generator=g).to(device)
    warm_ids = torch.randint(0, vocab, (1, min(8, args.prompt_tokens)), generator=g).to(device)
    decode_impl = _decode_impl(args.decode_experts_impl, _experts_impl_of(model), device)

    def measure(x: torch.Tensor, n: int) -> dict[str, Any]:
        if args.method == "loop":
            return greedy_loop(model, x, n, device, decode_impl)
        return generate_timing(model, x, n, device)

    with torch.inference_mode():
        _, warm_s = _timed(device, lambda: measure(warm_ids, max(1, args.warmup_tokens)))
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        r = measure(ids, gen_tokens)

    steps = r.pop("step_s")
    decode_tok_s = (gen_tokens - 1) / r["decode_s"] if gen_tokens > 1 and r["decode_s"] > 0 else None
    return {
        "engine": "hf-transformers",
        "model_dir": str(args.model_dir),
        "model_type": model.config.model_type,
        "num_hidden_layers": model.config.num_hidden_layers,
        "mode": args.mode,
        "method": args.method,
        "gpu_memory_budget": args.gpu_memory if args.mode == "offload" else None,
        "experts_impl_requested": args.experts_impl,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": gen_tokens,
        "seed": args.seed,
        **facts,
        "warmup_s": warm_s,
        "ttft_s": r["ttft_s"],
        "decode_s": r["decode_s"],
        "decode_tok_s": decode_tok_s,
        "decode_step_ms_median": statistics.median(steps) * 1e3 if steps else None,
        "decode_step_ms_max": max(steps) * 1e3 if steps else None,
        "decode_experts_impl": r["decode_experts_impl"],
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / GIB if device.startswith("cuda") else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if device.startswith("cuda") else None,
        "load_peak_alloc_gib": load_peak,
        "generated_token_ids": r["tokens"],
        "env": _env(device),
    }


def _decode_impl(flag: str, prefill_impl: str | None, device: str) -> str | None:
    """Resolve --decode-experts-impl: 'auto' = generate()'s rule (grouped_mm -> batched_mm off CPU)."""
    if flag == "same":
        return None
    if flag == "auto":
        return "batched_mm" if prefill_impl == "grouped_mm" and not device.startswith("cpu") else None
    return flag


def _env(device: str) -> dict[str, Any]:
    """Versions and hardware, so a JSON file is self-describing."""
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import accelerate

        env["accelerate"] = accelerate.__version__
    except ImportError:
        env["accelerate"] = None
    try:  # transformers runs its Qwen3-Next / Qwen3.5 linear attention on fla's kernels when it imports
        import fla

        env["fla"] = fla.__version__
    except ImportError:
        env["fla"] = None
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = torch.version.cuda
    return env


def summary_line(r: dict[str, Any]) -> str:
    """One line for logs: the numbers people compare."""
    tok_s = f"{r['decode_tok_s']:.3f}" if r["decode_tok_s"] is not None else "n/a"
    peak = f"{r['peak_alloc_gib']:.2f}" if r["peak_alloc_gib"] is not None else "n/a"
    budget = f" budget={r['gpu_memory_budget']}" if r["gpu_memory_budget"] else ""
    return (
        f"hf {r['mode']}{budget} {r['model_type']} L={r['num_hidden_layers']} experts={r['experts_impl_effective']}"
        f"/{r['decode_experts_impl']} attn={r['attn_impl_effective']} prompt={r['prompt_tokens']} gen={r['gen_tokens']} | load {r['load_s']:.1f}s"
        f" | TTFT {r['ttft_s'] * 1e3:.1f} ms | decode {tok_s} tok/s | peak GPU {peak} GiB"
        f" | weights {r['weight_gib_by_device']}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--mode", required=True, choices=("resident", "offload"))
    ap.add_argument("--gpu-memory", default="16GiB", help="offload: GPU budget for accelerate's max_memory")
    ap.add_argument("--cpu-memory", default="120GiB", help="offload: host budget for accelerate's max_memory")
    ap.add_argument("--experts-impl", default="grouped_mm", choices=("grouped_mm", "batched_mm", "eager"))
    ap.add_argument(
        "--decode-experts-impl",
        default="auto",
        choices=("auto", "same", "grouped_mm", "batched_mm", "eager"),
        help="auto: like generate() (grouped_mm -> batched_mm for decode on GPU); same: keep --experts-impl",
    )
    ap.add_argument("--attn-impl", default="auto",
                    help="auto (default): transformers' choice, sdpa where the model supports it (GPT-OSS: eager)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=None, help="default 32 (resident) / 4 (offload)")
    ap.add_argument("--warmup-tokens", type=int, default=2)
    ap.add_argument(
        "--method", default="loop", choices=("loop", "generate"), help="manual timed loop or model.generate"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda:0", help="cuda:N; 'cpu' only for a smoke test of resident mode")
    ap.add_argument("--json", type=Path, default=None, help="write the result record here")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_benchmark(args)
    print(summary_line(result), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
