"""The training module: transformers' Qwen3MoeForCausalLM layout and math in plain torch, with interchangeable expert kernels (loop, dense, grouped) validated against each other."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


import torch
import torch.nn.functional as F
from torch import nn

from demo_training.settings import ModelShape, log

class RMSNorm(nn.Module):
    """Qwen3MoeRMSNorm: normalize in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_tables(shape: ModelShape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (positions x head_dim, fp32) of Qwen3's default rotary embedding."""
    dim = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
    positions = torch.arange(shape.max_position_embeddings, dtype=torch.float, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Qwen3 attention: per-head q/k RMSNorm before RoPE, GQA, causal SDPA."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        h, hd = shape.hidden_size, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, hd
        self.q_proj = nn.Linear(h, shape.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, shape.rms_norm_eps)
        self.k_norm = RMSNorm(hd, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(rep, dim=1)  # same head mapping as transformers' repeat_kv
        v = v.repeat_interleave(rep, dim=1)
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class Router(nn.Module):
    """Holds the router weight under the transformers name ``mlp.gate.weight``."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape.num_experts, shape.hidden_size))


class Experts(nn.Module):
    """Expert weights in transformers' fused in-memory layout.

    gate_up_proj: (E, 2I, H) with the gate rows first; down_proj: (E, H, I).
    save_pretrained splits them into per-expert gate/up/down tensors.
    """

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        e, h, i = shape.num_experts, shape.hidden_size, shape.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def experts_loop(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Reference: transformers' eager per-expert loop (slow; used to validate the fast paths)."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    inter = down.shape[2]
    for e in torch.unique(idx).tolist():
        token, slot = torch.where(idx == e)
        h = F.linear(x[token], gate_up[e])
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], down[e])
        out.index_add_(0, token, y.float() * w[token, slot, None].float())
    return out.to(x.dtype)


def experts_dense(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Every expert on every token, unselected experts weighted by exactly zero.

    Same math as the sparse loop (the routing weight is applied before the linear down
    projection instead of after it), built from two large ordinary GEMMs: 16x the expert
    FLOPs, but no data-dependent shapes, so it is a robust fallback and fast on CPU.
    """
    n, hidden = x.shape
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    dense_w = torch.zeros(n, e, dtype=w.dtype, device=w.device).scatter(1, idx, w)
    h = F.linear(x, gate_up.reshape(e * two_i, hidden)).view(n, e, two_i)
    act = F.silu(h[..., :inter]) * h[..., inter:]
    act = act * dense_w.unsqueeze(-1).to(act.dtype)
    down_cat = down.permute(1, 0, 2).reshape(hidden, e * inter)
    return F.linear(act.reshape(n, e * inter), down_cat).to(x.dtype)


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert without a host sync (CUDA bincount reads the max back to the host)."""
    flat = indices.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(a, b, offs=offs)


def experts_grouped(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Sparse experts with torch's grouped GEMM in bf16 (what transformers' grouped_mm path does).

    Token-expert pairs are sorted by expert, each expert multiplies only its rows,
    results are un-permuted and summed per token in fp32 (deterministic, no atomics).
    Weights are cast to bf16 here so fp32 master weights still hit the fast kernel.
    """
    n, hidden = x.shape
    k = idx.shape[1]
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    flat = idx.reshape(-1)
    sorted_experts, perm = torch.sort(flat, stable=True)
    token = perm // k
    offs = torch.cumsum(expert_counts(sorted_experts, e), 0).to(torch.int32)
    xs = x[token].to(torch.bfloat16)
    h = _grouped_mm(xs, gate_up.to(torch.bfloat16).transpose(-2, -1), offs)
    act = F.silu(h[:, :inter]) * h[:, inter:]
    y = _grouped_mm(act.contiguous(), down.to(torch.bfloat16).transpose(-2, -1), offs)
    y = y.float() * w.reshape(-1)[perm].float().unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return y[inverse].view(n, k, hidden).sum(dim=1).to(x.dtype)


EXPERT_IMPLS: dict[str, ExpertsFn] = {"grouped": experts_grouped, "dense": experts_dense, "loop": experts_loop}


class SparseMoeBlock(nn.Module):
    """Qwen3MoeSparseMoeBlock: softmax router (fp32), top-k, renormalized weights."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.top_k = shape.top_k
        self.gate = Router(shape)
        self.experts = Experts(shape)
        self.impl = "dense"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, hidden = x.shape
        flat = x.reshape(-1, hidden)
        with torch.autocast(x.device.type, enabled=False):
            router_logits = F.linear(flat.float(), self.gate.weight.float())
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if torch.is_autocast_enabled(x.device.type):
            flat = flat.to(torch.get_autocast_dtype(x.device.type))
        out = EXPERT_IMPLS[self.impl](flat, top_i, top_w, self.experts.gate_up_proj, self.experts.down_proj)
        return out.view(b, t, hidden), router_logits, top_i


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = SparseMoeBlock(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        moe_out, router_logits, top_i = self.mlp(self.post_attention_layernorm(x))
        return x + moe_out, router_logits, top_i


class Backbone(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


@dataclass
class ForwardOutput:
    logits: torch.Tensor
    router_logits: list[torch.Tensor]
    top_indices: list[torch.Tensor]


class DemoMoeForCausalLM(nn.Module):
    """Plain-torch twin of Qwen3MoeForCausalLM: same state_dict keys, shapes and math."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.model = Backbone(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        cos, sin = rope_tables(shape, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def set_experts_impl(self, name: str) -> None:
        for layer in self.model.layers:
            layer.mlp.impl = name

    def forward(self, input_ids: torch.Tensor) -> ForwardOutput:
        t = input_ids.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.model.embed_tokens(input_ids)
        router_logits, top_indices = [], []
        for layer in self.model.layers:
            x, logits, top_i = layer(x, cos, sin)
            router_logits.append(logits)
            top_indices.append(top_i)
        return ForwardOutput(self.lm_head(self.model.norm(x)), router_logits, top_indices)


def init_weights(model: DemoMoeForCausalLM, std: float) -> None:
    """Normal(0, std) like transformers; residual-output projections scaled by 1/sqrt(2 * layers)."""
    out_std = std / math.sqrt(2 * model.shape.num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            elif name.endswith(("o_proj.weight", "experts.down_proj")):
                param.normal_(0.0, out_std)
            else:
                param.normal_(0.0, std)


def load_balancing_loss(
    top_indices: Sequence[torch.Tensor], router_logits: Sequence[torch.Tensor], num_experts: int
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss E * sum_e(f_e * P_e), per layer, averaged over layers.

    f_e = top-k assignments of expert e per token (sums to k), P_e = mean router
    probability; the loss equals k for perfectly uniform routing.  It is computed per
    MoE layer, as Switch Transformer and Megatron-LM define it.  transformers' load_balancing_loss_func
    pools f and P over all layers before multiplying, which leaves complementary
    per-layer collapse (each layer using its own few experts) unpenalized -- exactly the
    failure this demo model must avoid.  Only the gradient of P flows, as in both.
    """
    losses = []
    for top_i, logits in zip(top_indices, router_logits, strict=True):
        probs = torch.softmax(logits.float(), dim=-1)
        f = expert_counts(top_i, num_experts).float() / probs.shape[0]
        losses.append(num_experts * torch.sum(f * probs.mean(dim=0)))
    return torch.stack(losses).mean()


# ---------------------------------------------------------------------------------------------
# Expert-kernel selection
# ---------------------------------------------------------------------------------------------


def _run_experts(
    name: str, tensors: dict[str, torch.Tensor], autocast: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = {k: v.detach().clone().requires_grad_(k != "idx" and v.is_floating_point()) for k, v in tensors.items()}
    device_type = leaves["x"].device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        x = leaves["x"].to(torch.bfloat16) if autocast else leaves["x"]
        out = EXPERT_IMPLS[name](x, leaves["idx"], leaves["w"], leaves["gate_up"], leaves["down"])
    out.float().pow(2).sum().backward()
    grads = [leaves[k].grad for k in ("x", "w", "gate_up", "down")]
    return out.detach().float(), grads


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / (b.float().norm() + 1e-12))


def random_expert_problem(shape: ModelShape, tokens: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden_size, shape.moe_intermediate_size
    x = torch.randn(tokens, h, generator=gen)
    logits = torch.randn(tokens, e, generator=gen) * 2.0
    top_w, idx = torch.topk(torch.softmax(logits, -1), shape.top_k, dim=-1)
    w = top_w / top_w.sum(-1, keepdim=True)
    gate_up = torch.randn(e, 2 * i, h, generator=gen) * 0.05
    down = torch.randn(e, h, i, generator=gen) * 0.05
    problem = {"x": x, "idx": idx, "w": w, "gate_up": gate_up, "down": down}
    return {k: v.to(device) for k, v in problem.items()}


def validate_expert_impls(shape: ModelShape, device: torch.device, autocast: bool) -> dict[str, Any]:
    """Check each fast path (forward and all gradients) against the eager reference loop."""
    problem = random_expert_problem(shape, tokens=512, device=device, seed=0)
    ref_out, ref_grads = _run_experts("loop", problem, autocast=False)
    report: dict[str, Any] = {}
    for name in ("grouped", "dense"):
        try:
            out, grads = _run_experts(name, problem, autocast=autocast or name == "grouped")
        except (RuntimeError, NotImplementedError, TypeError, AttributeError) as exc:  # kernel unavailable
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        errors = [_rel_err(out, ref_out)] + [_rel_err(g, r) for g, r in zip(grads, ref_grads, strict=True)]
        report[name] = {"ok": max(errors) < 0.05, "max_rel_err": max(errors)}
    return report


def time_expert_impl(
    name: str, shape: ModelShape, tokens: int, device: torch.device, autocast: bool, reps: int = 3
) -> float:
    """Seconds per forward+backward of one MoE layer at the training micro-batch size."""
    problem = random_expert_problem(shape, tokens=tokens, device=device, seed=1)
    _run_experts(name, problem, autocast)  # warm-up (kernel selection, allocator)
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        _run_experts(name, problem, autocast)
    sync(device)
    return (time.perf_counter() - start) / reps


def choose_experts_impl(
    requested: str, shape: ModelShape, tokens: int, device: torch.device, autocast: bool
) -> tuple[str, dict[str, Any]]:
    """Validated and fastest expert kernel ('auto'), or the requested one after validation."""
    report = validate_expert_impls(shape, device, autocast)
    log(f"expert kernel validation vs eager loop: {report}")
    usable = [name for name in ("grouped", "dense") if report[name]["ok"]]
    if requested != "auto":
        if requested != "loop" and requested not in usable:
            raise SystemExit(f"experts impl {requested!r} failed validation: {report[requested]}")
        return requested, report
    if not usable:
        log("WARNING: no fast expert kernel validated; falling back to the slow eager loop")
        return "loop", report
    timings = {name: time_expert_impl(name, shape, tokens, device, autocast) for name in usable}
    report["timings_s_per_layer_fwd_bwd"] = timings
    choice = min(timings, key=timings.get)
    log(f"expert kernel timings (s per layer fwd+bwd, {tokens} tokens): {timings} -> {choice}")
    return choice, report


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
