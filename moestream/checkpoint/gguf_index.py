"""A GGUF checkpoint's dense tensors under our names, for the loader that reads a safetensors folder.

`GGUFIndex` answers the questions `engine/weights.py` asks a `TensorIndex` (is a tensor there,
read it as floats of the expected shape) for the tensors llama.cpp names (gguf_file.py maps the
names), and, as the loader's `StoredReader`, gives the linears stored in a block type our affine
formats hold exactly (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K: quant/ggml.py) as `QuantLinear` parts, the
same weights bit for bit. Everything else is read as stored (F32/F16/BF16) or dequantized (Q6_K,
and quantized embeddings, norms, routers). llama.cpp's q/k row permutation (Mixtral) is undone
on the rows, whichever the type: quantized rows are independent.

Qwen3-Next (`qwen3next`): its converter's value transforms are undone as each tensor is read
(norms stored as 1 + w, A_log stored as -exp(A_log)); a tensor it split or regrouped by rows is
put back from the rows of its parts (`RowSource`): in_proj_qkvz from attn_qkv ([all q; all k;
all v]) and attn_gate (z), interleaved again per key head as [q, k, v, z]; q/k/v of a
full-attention layer from a fused attn_qkv. Such a linear stays in its blocks when its parts
are of exact block types (at the widest one's bits), and is read as floats otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.checkpoint.gguf_file import GGUFCheckpoint, GGUFTensor
from moestream.checkpoint.safetensors_index import OpenFiles, read_exactly
from moestream.errors import CheckpointError
from moestream.quant import QuantSpec
from moestream.quant import ggml
from moestream.quant.recipe import module_class


def unsupported(t: GGUFTensor, where: str) -> CheckpointError:
    return CheckpointError(f"tensor {t.name!r} of {where} is stored as {t.type_name}, a ggml type moestream does "
                           "not read (it reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and MXFP4); use "
                           "a GGUF quantized to one of those.")


class GGUFReads:
    """Byte reads of GGUF tensors (pread on descriptors opened once, shared by threads)."""

    def __init__(self, ckpt: GGUFCheckpoint):
        self.ckpt = ckpt
        self.files = OpenFiles()

    def raw(self, t: GGUFTensor, start: int = 0, nbytes: int | None = None) -> Tensor:
        """`nbytes` bytes of `t`'s data from byte `start` (default: all of it), as uint8."""
        nbytes = t.nbytes - start if nbytes is None else nbytes
        out = torch.empty(nbytes, dtype=torch.uint8)
        read_exactly(self.files.fd(t.path, "check that it exists and is readable"), out, t.offset + start, t.path,
                     repr(t.name))
        return out

    def rows(self, t: GGUFTensor, first: int = 0, count: int | None = None) -> tuple[Tensor, str]:
        """Rows [first, first + count) of `t` (a row: K values of the last dimension), as (count, bytes
        per row) uint8 for block types or (count, K) floats, with the type's name."""
        name = t.type_name
        rows = 1
        for d in t.shape[:-1]:
            rows *= d
        per_row = t.nbytes // rows
        count = rows - first if count is None else count
        raw = self.raw(t, first * per_row, count * per_row).view(count, per_row)
        if name in ggml.FLOAT_TYPES:
            return raw.view(ggml.FLOAT_TYPES[name]), name
        return raw, name


def _unpermute(w: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's q/k permutation of rows (its converter took each head's rows as (2, d/2) and
    stored them as (d/2, 2): rotary pairs interleaved): (d/2, 2) → (2, d/2) per head."""
    n = w.shape[0]
    return w.reshape(heads, n // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class RowSource:
    """A tensor of ours made of rows of GGUF tensors: `parts` (each (n_i, K), one K) stacked, then
    rows `order` taken."""
    parts: tuple[str, ...]
    order: Tensor


def qkvz_order(key_heads: int, key_dim: int, value_heads: int, value_dim: int) -> Tensor:
    """in_proj_qkvz's rows (per key head: q, k, v, z; the head's value heads together) as rows of
    attn_qkv stacked over attn_gate. llama.cpp's converter (conversion/qwen.py,
    Qwen3NextModel.modify_tensors) viewed in_proj_qkvz as (key heads, q + k + v + z), split it and
    stored every head's q, then every k, then every v as attn_qkv and every z as attn_gate."""
    r = value_heads // key_heads
    qk, v = key_heads * key_dim, r * value_dim
    rows = []
    for g in range(key_heads):
        rows += [torch.arange(g * key_dim, (g + 1) * key_dim),                       # q
                 torch.arange(qk + g * key_dim, qk + (g + 1) * key_dim),             # k
                 torch.arange(2 * qk + g * v, 2 * qk + (g + 1) * v),                 # v
                 torch.arange(2 * qk + key_heads * v + g * v, 2 * qk + key_heads * v + (g + 1) * v)]   # z
    return torch.cat(rows)


def qwen3next_rows(ckpt: GGUFCheckpoint, config: ModelConfig) -> dict[str, RowSource]:
    """Qwen3-Next's linears that a GGUF stores by other rows: a linear-attention layer's
    in_proj_qkvz as attn_qkv + attn_gate (current conversions; older ones keep it whole as ssm_in,
    read by name), and a full-attention layer's q/k/v fused into attn_qkv (the converter's
    --fuse-qkv: q with its gate, then k, then v)."""
    out = {}
    lin = config.linear_attention
    for layer, mixer in enumerate(config.layer_mixers):
        qkv, ours = f"blk.{layer}.attn_qkv.weight", f"model.layers.{layer}"
        if qkv not in ckpt.tensors:
            continue
        if mixer == "gated_deltanet":
            gate = f"blk.{layer}.attn_gate.weight"
            if gate not in ckpt.tensors:
                raise CheckpointError(f"tensor {gate!r} is missing from {ckpt.path.name} beside {qkv!r}; the GGUF is "
                                      "incomplete.")
            out[f"{ours}.linear_attn.in_proj_qkvz.weight"] = RowSource(
                (qkv, gate), qkvz_order(lin.key_heads, lin.key_dim, lin.value_heads, lin.value_dim))
        else:
            q, kv = 2 * config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            for proj, start, n in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
                out[f"{ours}.self_attn.{proj}.weight"] = RowSource((qkv,), torch.arange(start, start + n))
    return out


class GGUFIndex(GGUFReads):
    """Dense tensors by our names (a TensorIndex for the loader) and the reader of the linears kept
    quantized."""

    def __init__(self, ckpt: GGUFCheckpoint, spec: ArchSpec, config: ModelConfig):
        super().__init__(ckpt)
        self.folder: Path = ckpt.path
        self.names = ckpt.hf_names(spec.moe_prefix, spec.shared_expert_name, spec.router_name)
        self.config = config
        # newer conversions of DeepSeek store kv_b_proj split per head: attn_k_b (H, kv_lora, nope), transposed,
        # and attn_v_b (H, v, kv_lora); the loader gets kv_b_proj back whole
        self.kv_b: dict[str, tuple[str, str]] = {}
        for name in ckpt.tensors:
            if name.endswith(".attn_k_b.weight"):
                layer = name.split(".")[1]
                ours = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
                if ours not in self.names:
                    self.kv_b[ours] = (name, f"blk.{layer}.attn_v_b.weight")
        self.row_sources = qwen3next_rows(ckpt, config) if ckpt.architecture == "qwen3next" else {}
        for name in [*self.names.values(), *(n for pair in self.kv_b.values() for n in pair),
                     *(n for source in self.row_sources.values() for n in source.parts)]:
            t = ckpt.tensors.get(name)
            if t is not None and not ggml.readable(t.type_name):
                raise unsupported(t, ckpt.path.name)

    def __contains__(self, name: str) -> bool:
        return name in self.names or name in self.kv_b or name in self.row_sources

    def info(self, name: str) -> GGUFTensor:
        if name in self.kv_b:
            return self.ckpt.tensors[self.kv_b[name][0]]
        if name in self.row_sources:
            return self.ckpt.tensors[self.row_sources[name].parts[0]]
        try:
            return self.ckpt.tensors[self.names[name]]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} (llama.cpp's name for it is missing) is not in "
                                  f"{self.ckpt.path.name}; the GGUF is incomplete or not of this architecture."
                                  ) from None

    def _heads(self, name: str) -> int | None:
        """The head count whose rows llama.cpp permuted in tensor `name`, None when it did not."""
        if not self.ckpt.permuted_qk:
            return None
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return self.config.num_heads
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            return self.config.num_kv_heads
        return None

    def read(self, name: str, expected_shape: tuple[int, ...] | None = None, floating: bool = False) -> Tensor:
        """The tensor as floats (read as stored, or dequantized), reshaped to `expected_shape` when
        its values are that many (GGUF keeps (1, H) gates as (H,))."""
        if name in self.kv_b:
            w = self._kv_b(name)
        elif name in self.row_sources:
            source = self.row_sources[name]
            w = torch.cat([self._floats(self.ckpt.tensors[part]) for part in source.parts])[source.order]
        else:
            w = self._floats(self.info(name))
        t = self.info(name)
        heads = self._heads(name)
        if heads is not None:
            w = _unpermute(w, heads)
        if self.ckpt.norms_plus_one and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w.float() - 1   # the converter's rule: every norm.weight but linear attention's gated one, + 1
        if name.endswith("linear_attn.A_log"):
            w = self._a_log(t, w)
        if expected_shape is not None:
            if w.numel() != _numel(expected_shape):
                raise CheckpointError(f"tensor {t.name!r} of {self.ckpt.path.name} has shape {list(t.shape)} but the "
                                      f"metadata implies {list(expected_shape)}; the GGUF does not match its metadata.")
            w = w.reshape(expected_shape)
        return w

    def _floats(self, t: GGUFTensor) -> Tensor:
        rows, type_name = self.rows(t)
        w = rows.clone() if type_name in ggml.FLOAT_TYPES else ggml.dequantize_blocks(rows, type_name, t.shape[-1])
        return w.reshape(t.shape)

    def _a_log(self, t: GGUFTensor, w: Tensor) -> Tensor:
        """A_log from ssm_a, where llama.cpp's converter stored -exp(A_log) (computed in float64 here:
        exp of the result is ssm_a again to within one rounding)."""
        if bool((w > 0).any()):
            raise CheckpointError(f"tensor {t.name!r} of {self.ckpt.path.name} holds positive values where llama.cpp "
                                  "stores -exp(A_log); the GGUF is damaged, re-convert it.")
        return torch.log(-w.double()).float()

    def _kv_b(self, name: str) -> Tensor:
        """kv_b_proj (H·(nope + v), kv_lora) from attn_k_b (H, kv_lora, nope) and attn_v_b (H, v, kv_lora)."""
        k_name, v_name = self.kv_b[name]
        if v_name not in self.ckpt.tensors:
            raise CheckpointError(f"tensor {v_name!r} is missing from {self.ckpt.path.name} beside {k_name!r}; the "
                                  "GGUF is incomplete.")
        k_b, v_b = self._floats(self.ckpt.tensors[k_name]), self._floats(self.ckpt.tensors[v_name])
        w = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
        return w.reshape(-1, w.shape[-1])

    # ---- StoredReader: linears kept in their blocks ---------------------------------------------
    def stored_spec(self, path: str) -> QuantSpec | None:
        """The affine spec the module at `path` is held in (exact block types in attention, shared
        experts, the embeddings and the LM head), None when it is read as floats. A linear rebuilt
        from parts of different exact types is held at the widest one's bits (4-bit codes are
        8-bit codes too, with the same scales and biases: still exact)."""
        name = f"{path}.weight"   # (a kv_b_proj put together from its halves is read as floats)
        if (name not in self.names and name not in self.row_sources) or \
                module_class(path)[0] not in ("attention", "shared", "embeddings"):
            return None
        parts = self.row_sources[name].parts if name in self.row_sources else (self.names[name],)
        types = {self.ckpt.tensors[part].type_name for part in parts}
        if not all(t in ggml.EXACT for t in types):
            return None
        return ggml.common_spec(types)

    def holds(self, path: str) -> bool:
        return self.stored_spec(path) is not None

    def parts(self, path: str, n: int, k: int) -> dict[str, Tensor]:
        name = f"{path}.weight"
        source = self.row_sources.get(name)
        tensors = [self.ckpt.tensors[part] for part in source.parts] if source else [self.info(name)]
        shape = (len(source.order) if source else tensors[0].shape[0], *tensors[0].shape[1:])
        if tuple(shape) != (n, k) or any(t.shape[1:] != (k,) for t in tensors):
            t = tensors[0]
            raise CheckpointError(f"tensor {t.name!r} of {self.ckpt.path.name} has shape {list(t.shape)} but the "
                                  f"metadata implies {[n, k]}; the GGUF does not match its metadata.")
        if source:   # each part's codes, scales and biases, stacked, the rows put in order, packed at one width
            codes, scales, biases = (torch.cat(parts)[source.order]
                                     for parts in zip(*(ggml.to_codes(*self.rows(t)) for t in tensors)))
            return ggml.in_spec(codes, scales, biases, self.stored_spec(path), tensors[0].type_name).parts()
        rows, type_name = self.rows(tensors[0])
        heads = self._heads(name)
        if heads is not None:
            rows = _unpermute(rows, heads)
        return ggml.to_affine(rows, type_name).parts()

    def dense(self, path: str, n: int, k: int) -> Tensor:
        return self.read(f"{path}.weight", (n, k))


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
