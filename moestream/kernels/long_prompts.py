"""When a quantized MoE call takes the long prompts' path: every slot dequantized into the hidden
dtype once, then the plain grouped GEMMs (dequant_slots_triton.py), instead of each weight tile
dequantized per M-block inside the tensor-core loop (moe_tiles.gated_dot).

The in-register path wins while a slot has few rows (its tiles are dequantized once or twice); the
dequantizing pass costs the same at any length (it streams every slot's bytes once and writes them
in bf16), so past a length it wins. Measured on an H200 with Qwen3-30B-A3B's layer (128 slots,
top-8; `benchmarks/fused_moe_kernel.py --format F --tokens 128 512 2048 4096`), microseconds of the
in-register path against the dequantized one: int4-g64 991 / 1,506 at 512 tokens, 5,550 / 1,721 at
2,048; FP8 128x128 411 / 991 at 512, 1,280 / 1,205 at 2,048, 2,111 / 1,574 at 4,096; int8 1,323 /
1,391 at 2,048, 2,173 / 1,759 at 4,096. Plain Python (no Triton), so the memory plan can ask too.
"""

from __future__ import annotations

import torch

# A call of at least this many tokens takes the dequantized path: formats of under 8 bits a value
# (their in-register unpacking costs the most), and those of a byte a value (int8, FP8).
PACKED_MIN_TOKENS = 1024
BYTE_MIN_TOKENS = 3072
# Slots dequantized at a time: a call over more slots takes them in groups of this many, each group
# dequantized into one scratch and its pairs run, so the scratch stays a few hundred MB (32 of
# Qwen3-30B-A3B's experts in bf16: 302 MB) whatever the bank's capacity.
DEQUANT_GROUP_SLOTS = 32


def dequant_min_tokens(spec) -> int:
    """Tokens from which a call over slots quantized in `spec` (a QuantSpec or Fp8Spec) dequantizes
    them first."""
    return BYTE_MIN_TOKENS if getattr(spec, "kind", None) == "fp8" or spec.bits >= 8 else PACKED_MIN_TOKENS


def dequant_group_slots(num_slots: int) -> int:
    """Slots a call over `num_slots` slots dequantizes at a time."""
    return min(num_slots, DEQUANT_GROUP_SLOTS)


def dequant_scratch_bytes(num_slots: int, hidden: int, intermediate: int, dtype: torch.dtype) -> int:
    """The dequantized copy (gate_up and down) that path holds during a call over `num_slots` slots:
    one group's (`dequant_group_slots`)."""
    return dequant_group_slots(num_slots) * 3 * hidden * intermediate * torch.empty((), dtype=dtype).element_size()
