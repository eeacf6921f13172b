"""The training loop: window sampling, LR schedule, AdamW, losses with the load-balancing term, held-out checks and early stopping."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field


import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from demo_training.model import DemoMoeForCausalLM, load_balancing_loss
from demo_training.settings import TrainSettings, log



def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class WindowSampler:
    """Epoch-shuffled, non-overlapping windows of seq_len + 1 tokens over the train stream.

    Each epoch shifts the window grid by a seeded random offset, so later epochs see
    different boundaries; the order is seeded per epoch, hence reproducible.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int) -> None:
        if tokens.numel() < 2 * (seq_len + 1):
            raise SystemExit(f"train stream too short ({tokens.numel()} tokens) for seq_len {seq_len}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.epoch = -1
        self.tokens_seen = 0
        self._order: torch.Tensor = torch.empty(0, dtype=torch.long)
        self._pos = 0
        self._offsets = torch.arange(seq_len + 1, device=tokens.device)

    def _new_epoch(self) -> None:
        self.epoch += 1
        gen = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        offset = int(torch.randint(0, self.seq_len, (1,), generator=gen)) if self.epoch else 0
        count = (self.tokens.numel() - offset - 1) // self.seq_len
        starts = offset + torch.arange(count) * self.seq_len
        self._order = starts[torch.randperm(count, generator=gen)].to(self.tokens.device)
        self._pos = 0

    def next(self, batch: int) -> torch.Tensor:
        if self._pos + batch > self._order.numel():
            self._new_epoch()
        starts = self._order[self._pos : self._pos + batch]
        self._pos += batch
        self.tokens_seen += batch * self.seq_len
        return self.tokens[starts[:, None] + self._offsets].long()

    @property
    def epochs_done(self) -> float:
        per_epoch = max(1, (self.tokens.numel() - 1) // self.seq_len)
        return self.epoch + self._pos / per_epoch


def lr_at(step: int, total_steps: int, settings: TrainSettings, warmup: int) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at total_steps."""
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return settings.lr * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * cosine)


def make_optimizer(model: nn.Module, settings: TrainSettings, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norm scales (1-D parameters)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(settings.beta1, settings.beta2), **extra)


def compute_losses(model: DemoMoeForCausalLM, batch: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean next-token cross-entropy, load-balancing aux loss) of a (B, T+1) token batch."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(inputs)
    ce = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), targets.reshape(-1))
    aux = load_balancing_loss(out.top_indices, out.router_logits, model.shape.num_experts)
    return ce, aux


@torch.no_grad()
def heldout_loss(model: DemoMoeForCausalLM, windows: torch.Tensor, micro: int, autocast: bool) -> float:
    """Mean next-token loss over fixed held-out windows (the early-stopping signal)."""
    model.eval()
    total = 0.0
    for start in range(0, windows.shape[0], micro):
        ce, _ = compute_losses(model, windows[start : start + micro], autocast)
        total += float(ce) * windows[start : start + micro].shape[0]
    model.train()
    return total / windows.shape[0]


@dataclass
class TrainResult:
    best_state: dict[str, torch.Tensor]
    best_step: int
    best_heldout_loss: float
    steps: int
    tokens: int
    epochs: float
    seconds: float
    stop_reason: str
    curve: list[dict[str, float]] = field(default_factory=list)


def heldout_windows(tokens: np.ndarray, seq_len: int, count: int, device: torch.device) -> torch.Tensor:
    """`count` windows of seq_len + 1 tokens spread evenly over the held-out stream (fixed for the run)."""
    usable = min(count, (len(tokens) - 1) // seq_len)
    if usable < 1:
        raise SystemExit("held-out split too small for one evaluation window")
    t = torch.from_numpy(tokens.astype(np.int64))
    starts = torch.linspace(0, len(tokens) - seq_len - 1, usable).long()
    return t[starts[:, None] + torch.arange(seq_len + 1)].to(device)


@dataclass
class StepPlan:
    """Total steps, warm-up and evaluation interval.

    With --max-steps they are fixed.  Otherwise the total is first estimated after
    CALIBRATION_STEPS and re-estimated at every evaluation from the throughput measured
    so far, so that the cosine schedule ends when the wall-clock budget does.
    """

    total: int
    warmup: int
    eval_every: int | None

    CALIBRATION_STEPS = 30

    @classmethod
    def initial(cls, settings: TrainSettings) -> StepPlan:
        if settings.max_steps:
            warmup = min(settings.warmup_steps, max(1, settings.max_steps // 5))
            return cls(settings.max_steps, warmup, max(1, settings.max_steps // settings.evals_per_run))
        return cls(10**9, settings.warmup_steps, None)  # no evaluation before calibration

    def replan(self, step: int, elapsed: float, budget_s: float, settings: TrainSettings) -> None:
        if settings.max_steps or step < self.CALIBRATION_STEPS or step >= self.total:
            return  # fixed plan, too early to measure, or the schedule has already ended
        first = self.eval_every is None
        self.total = max(step + 1, int(step * budget_s / elapsed * (0.97 if first else 1.0)))
        if first:
            self.eval_every = max(25, self.total // settings.evals_per_run)
            self.warmup = min(settings.warmup_steps, max(1, self.total // 10))


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def train(
    model: DemoMoeForCausalLM,
    train_tokens: np.ndarray,
    heldout_tokens: np.ndarray,
    settings: TrainSettings,
    device: torch.device,
    budget_s: float,
) -> TrainResult:
    """AdamW + warm-up/cosine under a wall-clock budget, keeping the best held-out weights.

    Stops at the step plan's end, at the time budget, or early when the held-out loss
    has not improved by min_delta for `patience` evaluations (levelled off / overfitting
    on repeated epochs).
    """
    autocast = device.type == "cuda"
    sampler = WindowSampler(torch.from_numpy(train_tokens.astype(np.int32)).to(device), settings.seq_len, settings.seed)
    eval_set = heldout_windows(heldout_tokens, settings.seq_len, settings.eval_windows, device)
    optimizer = make_optimizer(model, settings, device)
    accum = max(1, settings.batch_seqs // settings.micro_batch_seqs)
    micro = settings.batch_seqs // accum
    plan = StepPlan.initial(settings)
    start = time.time()
    best_loss, best_step, best_state, stale = float("inf"), 0, None, 0
    curve: list[dict[str, float]] = []
    running, running_n = torch.zeros(2, device=device), 0
    stop_reason = "planned steps done"
    step = 0
    model.train()
    while step < plan.total:
        lr = lr_at(step, plan.total, settings, plan.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for _ in range(accum):
            ce, aux = compute_losses(model, sampler.next(micro), autocast)
            ((ce + settings.router_aux_loss_coef * aux) / accum).backward()
            running += torch.stack([ce.detach(), aux.detach()]) / accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        running_n += 1
        elapsed = time.time() - start
        if step == StepPlan.CALIBRATION_STEPS and plan.eval_every is None:
            plan.replan(step, elapsed, budget_s, settings)
            log(
                f"throughput {sampler.tokens_seen / elapsed:,.0f} tok/s -> planning {plan.total} steps, eval every {plan.eval_every}"
            )
        if step % settings.log_every == 0 or step == plan.total:
            ce_avg, aux_avg = (running / running_n).tolist()
            log(
                f"step {step}/{plan.total} loss {ce_avg:.4f} aux/k {aux_avg / model.shape.top_k:.4f} "
                f"lr {lr:.2e} tok {sampler.tokens_seen:,} ({sampler.epochs_done:.2f} ep) "
                f"{sampler.tokens_seen / elapsed:,.0f} tok/s"
            )
            running.zero_()
            running_n = 0
        out_of_time = elapsed >= budget_s
        if plan.eval_every and (step % plan.eval_every == 0 or step == plan.total or out_of_time):
            loss = heldout_loss(model, eval_set, micro, autocast)
            curve.append(
                {"step": step, "tokens": sampler.tokens_seen, "seconds": round(elapsed, 1), "heldout_loss": loss}
            )
            stale = 0 if loss < best_loss - settings.min_delta else stale + 1
            if loss < best_loss:
                best_loss, best_step, best_state = loss, step, cpu_state(model)
            log(
                f"eval step {step}: held-out loss {loss:.4f} (ppl {math.exp(loss):.2f}) best {best_loss:.4f} @ {best_step}"
            )
            plan.replan(step, time.time() - start, budget_s, settings)
            if stale >= settings.patience and step > plan.warmup:
                stop_reason = (
                    f"held-out loss levelled off (no gain > {settings.min_delta} in {settings.patience} evals)"
                )
                break
        if out_of_time:
            stop_reason = "time budget"
            break
    if best_state is None:  # stopped before the first evaluation
        best_loss, best_step, best_state = heldout_loss(model, eval_set, micro, autocast), step, cpu_state(model)
    return TrainResult(
        best_state,
        best_step,
        best_loss,
        step,
        sampler.tokens_seen,
        sampler.epochs_done,
        time.time() - start,
        stop_reason,
        curve,
    )


# ---------------------------------------------------------------------------------------------
# Export and verification through transformers
# ---------------------------------------------------------------------------------------------
