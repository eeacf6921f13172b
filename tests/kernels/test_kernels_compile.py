"""Every Triton kernel compiles for the H100 (sm_90) in every expert format, without a GPU.

The front end, the layout passes and LLVM's PTX back end run on the CPU, catching type errors, shape
errors and shared-memory blow-ups before any GPU time is spent. A compile takes seconds with an
empty Triton cache, so the switches that do not interact are covered pairwise (every value of each
switch with every expert format), not as a full product.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moestream.kernels.fused_moe_triton import _moe_grouped_gemm_kernel  # noqa: E402
from moestream.kernels.fused_moe_decode import _moe_decode_kernel  # noqa: E402
from moestream.kernels.moe_tiles import quant_block_k  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)


@pytest.fixture(autouse=True, scope="module")
def _stop_at_llvm_ir(tmp_path_factory):
    """Each compile stops at LLVM IR: LLVM's PTX back end and ptxas add instruction selection and
    register allocation only (the GPU suite runs the real binaries; ptxas was half of a compile with
    an empty cache, the PTX back end a fifth of the rest), while type and shape errors surface in the
    front end and a tile's shared memory is fixed in the lowering to LLVM IR. The compiles get a cache folder of
    their own, so the IR standing in for a binary can never be found by a launch."""
    from triton.backends.nvidia.compiler import CUDABackend

    original = CUDABackend.add_stages

    def add_stages(self, stages, options, *args, **kwargs):
        original(self, stages, options, *args, **kwargs)

        def no_ptx(llir, metadata):
            metadata["name"] = _kernel_name(llir)   # what the PTX stage would have named
            return llir

        stages["ptx"] = no_ptx
        stages["cubin"] = lambda ptx, metadata: ptx.encode()

    patch = pytest.MonkeyPatch()
    patch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("ptx_only_cache")))
    patch.setattr(CUDABackend, "add_stages", add_stages)
    yield
    patch.undo()


def _kernel_name(llir: str) -> str:
    """The kernel's entry point: the one function an LLVM module for the GPU defines."""
    return re.search(r"define\b[^@]*@([\w.$]+)\(", llir).group(1)


SMEM = 227 * 1024
FORMATS = [(0, 1, False), (8, 64, False), (4, 64, False), (4, 32, False), (3, 64, False), (2, 32, False),
           (4, 64, True), (3, 64, True)]
# FP8 e4m3 (BITS 8 with the FP8 switch): DeepSeek's 128 x 128 blocks, and per-channel scales (a
# block of one row by the whole width)
FP8_FORMATS = [(128, 128, 1), (1, 2048, 1), (128, 128, 2)]   # (block rows, block columns, hardware / portable e4m3)
FP8_OFF = {"FP8": 0, "SCALE_ROWS": 1}
INTS = ["N", "K", "stride_am", "stride_ak", "stride_be", "stride_bn", "stride_bk", "stride_cm", "stride_cn",
        "stride_se", "stride_sn", "stride_bias_e"]
FLOATS = ["alpha", "limit"]   # the clamped SwiGLU's parameters
# (activation code, expert biases): plain SwiGLU, and GPT-OSS's clamped SwiGLU with biases (dense experts)
EPILOGUES = [(0, False), (1, True)]
# Every format gated (two B tiles: the most registers and shared memory), the epilogues alternating; un-gated (the
# down projection's wider N and weighted sum) for bf16, 8, 4 and 3 bits with the other epilogue (the 2-bit, group-32
# and codebook formats' own loads compile in their gated cases; the un-gated tile only changes what is around them)
UNGATED = {(0, 1, False), (8, 64, False), (4, 64, False), (3, 64, False)}
DECODE_CASES = [(*fmt, gated, *EPILOGUES[(i + gated) % 2]) for i, fmt in enumerate(FORMATS) for gated in (True, False)
                if gated or fmt in UNGATED]


def _compile(fn, pointers: dict, ints: list[str], consts: dict, warps: int, stages: int, wide: tuple[str, ...] = ()):
    sig = {**pointers, **{name: "i64" if name in wide else "i32" for name in ints},
           **{name: "fp32" for name in FLOATS}, **{name: "constexpr" for name in consts}}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=H100,
                          options={"num_warps": warps, "num_stages": stages})


def _pointers(names: list[str], bits: int, nf: bool, fp8: bool = False, group: int = 0) -> dict:
    types = {"b_ptr": "*u8" if bits else "*bf16", "slot_ptr": "*i32", "pair_ids_ptr": "*i32", "block_slot_ptr": "*i32",
             "w_ptr": "*fp32", "code_ptr": "*fp32" if nf else "*bf16"}
    if (bits, group, nf) == (4, 32, False):   # int4-g32 as GGUF's Q4_0 is held: fp16 scales and biases
        types.update(s_ptr="*fp16", z_ptr="*fp16")
    if fp8:   # float32 scales (and the unused biases and code pointers are the scales)
        types.update(s_ptr="*fp32", z_ptr="*fp32", code_ptr="*fp32")
    return {name: types.get(name, "*bf16") for name in names}


@pytest.mark.parametrize("bits,group,nf,gated,activation,bias", DECODE_CASES)
def test_decode_kernel_compiles(bits, group, nf, gated, activation, bias):
    block_k = max(128 if nf else 512, quant_block_k(bits, group)) if bits else 128
    consts = {"A_BY_TOKEN": gated, "GATED": gated, "ACTIVATION": activation, "MUL_WEIGHT": not gated,
              "HAS_BIAS": bias, "PAIRS": 16,
              "BLOCK_M": 16, "BLOCK_N": 16 if gated else 32, "BLOCK_K": block_k,
              "EVEN_K": bits == 0 or gated,   # quantized: unmasked tiles gated, masked ones not
              "DOT_PRECISION": "tf32", "BITS": bits, "GROUP": group, "NF": nf, "USE_PDL": True, **FP8_OFF}
    pointers = _pointers(["a_ptr", "b_ptr", "c_ptr", "slot_ptr", "w_ptr", "s_ptr", "z_ptr", "code_ptr", "bias_ptr"],
                         bits, nf, group=group)
    ints = INTS + ["num_pairs", "num_slots", "num_host", "host_b", "host_s", "host_z", "top_k", "stride_st",
                   "stride_sj", "stride_wt", "stride_wj"]
    kernel = _compile(_moe_decode_kernel, pointers, ints, consts, 4, 4 if bits == 0 else 1,
                      wide=("host_b", "host_s", "host_z"))   # host stacks sit far from the slots
    assert kernel.metadata.shared <= SMEM


@pytest.mark.parametrize("bits,group,nf,activation,bias",
                         [(*fmt, *EPILOGUES[i % 2]) for i, fmt in enumerate(FORMATS)] + [(0, 1, False, *EPILOGUES[1])])
def test_grouped_kernel_compiles(bits, group, nf, activation, bias):
    consts = {"A_ROW_DIV": 8, "GATED": True, "ACTIVATION": activation, "MUL_WEIGHT": False, "HAS_BIAS": bias,
              "BLOCK_M": 128, "BLOCK_N": 64,
              "BLOCK_K": max(64, quant_block_k(bits, group)) if bits else 64, "GROUP_M": 8,
              "EVEN_K": True,   # the model shapes' (the decode test takes the ragged quantized loads)
              "DOT_PRECISION": "tf32", "BITS": bits, "GROUP": group, "NF": nf, **FP8_OFF}
    pointers = _pointers(["a_ptr", "b_ptr", "c_ptr", "w_ptr", "pair_ids_ptr", "block_slot_ptr", "s_ptr", "z_ptr",
                          "code_ptr", "bias_ptr"], bits, nf, group=group)
    kernel = _compile(_moe_grouped_gemm_kernel, pointers, INTS + ["num_pairs", "num_m_blocks", "slot_lo", "slot_hi"], consts, 8,
                      4 if bits == 0 else 2)
    assert kernel.metadata.shared <= SMEM


@pytest.mark.parametrize("scale_rows,group,mode,gated", [(*fmt, gated) for fmt in FP8_FORMATS[:2] for gated in (True, False)]
                         + [(*FP8_FORMATS[2], True)])
def test_fp8_decode_kernel_compiles(scale_rows, group, mode, gated):
    consts = {"A_BY_TOKEN": gated, "GATED": gated, "ACTIVATION": 0, "MUL_WEIGHT": not gated, "HAS_BIAS": False,
              "PAIRS": 16, "BLOCK_M": 16, "BLOCK_N": 16 if gated else 32, "BLOCK_K": 512 if gated else 256,
              "EVEN_K": False, "DOT_PRECISION": "tf32", "BITS": 8, "GROUP": group, "NF": False, "USE_PDL": True,
              "FP8": mode, "SCALE_ROWS": scale_rows}
    pointers = _pointers(["a_ptr", "b_ptr", "c_ptr", "slot_ptr", "w_ptr", "s_ptr", "z_ptr", "code_ptr", "bias_ptr"],
                         8, False, fp8=True)
    ints = INTS + ["num_pairs", "num_slots", "num_host", "host_b", "host_s", "host_z", "top_k", "stride_st",
                   "stride_sj", "stride_wt", "stride_wj"]
    kernel = _compile(_moe_decode_kernel, pointers, ints, consts, 4, 1, wide=("host_b", "host_s", "host_z"))
    assert kernel.metadata.shared <= SMEM


@pytest.mark.parametrize("scale_rows,group,mode", FP8_FORMATS)
def test_fp8_grouped_kernel_compiles(scale_rows, group, mode):
    consts = {"A_ROW_DIV": 8, "GATED": True, "ACTIVATION": 0, "MUL_WEIGHT": False, "HAS_BIAS": False,
              "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "EVEN_K": False,
              "DOT_PRECISION": "tf32", "BITS": 8, "GROUP": group, "NF": False, "FP8": mode, "SCALE_ROWS": scale_rows}
    pointers = _pointers(["a_ptr", "b_ptr", "c_ptr", "w_ptr", "pair_ids_ptr", "block_slot_ptr", "s_ptr", "z_ptr",
                          "code_ptr", "bias_ptr"], 8, False, fp8=True)
    kernel = _compile(_moe_grouped_gemm_kernel, pointers, INTS + ["num_pairs", "num_m_blocks", "slot_lo", "slot_hi"], consts, 8, 2)
    assert kernel.metadata.shared <= SMEM


@pytest.mark.parametrize("row", range(5))
def test_fp8_grouped_kernel_fits_every_quantized_tile(row):
    """Each row of the quantized grouped tile table, with FP8 128 x 128 experts: the scales are read
    per block, not per value, so the pipeline's shared memory stays within the H100's."""
    from moestream.kernels.fused_moe_triton import _QUANT_CONFIG_TABLE

    cfg = _QUANT_CONFIG_TABLE[row][1]
    tile = cfg.gate_up
    consts = {"A_ROW_DIV": 8, "GATED": True, "ACTIVATION": 0, "MUL_WEIGHT": False, "HAS_BIAS": False,
              "BLOCK_M": cfg.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k, "GROUP_M": tile.group_m,
              "EVEN_K": True, "DOT_PRECISION": "tf32", "BITS": 8, "GROUP": 128, "NF": False, "FP8": 1,
              "SCALE_ROWS": 128}   # whole tiles: the bytes' loads pipelined, the most shared memory
    pointers = _pointers(["a_ptr", "b_ptr", "c_ptr", "w_ptr", "pair_ids_ptr", "block_slot_ptr", "s_ptr", "z_ptr",
                          "code_ptr", "bias_ptr"], 8, False, fp8=True)
    kernel = _compile(_moe_grouped_gemm_kernel, pointers, INTS + ["num_pairs", "num_m_blocks", "slot_lo", "slot_hi"], consts,
                      tile.num_warps, tile.num_stages)
    assert kernel.metadata.shared <= SMEM


def _sig(pointers: dict, ints: list[str], floats: list[str], consts: dict) -> dict:
    return {**pointers, **{n: "i32" for n in ints}, **{n: "fp32" for n in floats}, **{n: "constexpr" for n in consts}}


@pytest.mark.parametrize("bias", [False, True])
def test_gemv_kernel_compiles(bias):
    from moestream.kernels.gemv_triton import _gemv_kernel

    consts = {"HAS_BIAS": bias, "BLOCK_N": 4, "BLOCK_K": 512, "EVEN_K": True, "USE_PDL": True}
    sig = _sig({n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")}, ["N", "K", "stride_wn"], [], consts)
    triton.compile(ASTSource(fn=_gemv_kernel, signature=sig, constexprs=consts), target=H100,
                   options={"num_warps": 8, "num_stages": 3})


# (has_map, epilogue, reduce, split): every pair of two switches' values appears in some case
TOKEN_CASES = [(False, 0, True, False), (False, 1, False, True), (True, 0, False, True), (True, 1, True, False),
               (True, 1, False, False), (False, 0, True, True)]


@pytest.mark.parametrize("has_map,activation,bias,reduce,split",
                         [(m, *EPILOGUES[e], r, s) for m, e, r, s in TOKEN_CASES])
def test_token_kernels_compile(has_map, activation, bias, reduce, split):
    from moestream.kernels.fused_moe_token import _token_down_kernel, _token_gate_up_kernel

    ids = {"ids_ptr": "*i32", "map_ptr": "*i32"}
    consts = {"HAS_MAP": has_map, "HAS_BIAS": bias, "ACTIVATION": activation, "BLOCK_N": 2, "BLOCK_K": 2048,
              "EVEN_K": True, "SPLIT": split, "K_PAD": 8, "USE_PDL": True}
    sig = _sig({"x_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", **ids, "bias_ptr": "*bf16", "take_ptr": "*i32",
                "cut_ptr": "*i32"},
               ["I", "H", "num_slots", "num_host", "host_off", "top_k", "stride_id", "stride_be", "stride_bn",
                "stride_cm", "stride_bias"], FLOATS, consts)
    sig["host_off"] = "i64"   # host stacks sit far from the slots in the address space
    triton.compile(ASTSource(fn=_token_gate_up_kernel, signature=sig, constexprs=consts), target=H100,
                   options={"num_warps": 4})
    consts = {"HAS_MAP": has_map, "HAS_BIAS": bias, "REDUCE": reduce, "K_PAD": 8, "BLOCK_N": 4, "BLOCK_K": 128,
              "EVEN_K": False, "SPLIT": split, "USE_PDL": True}
    sig = _sig({"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16" if reduce else "*fp32", **ids,
                "w_ptr": "*fp32", "bias_ptr": "*bf16", "take_ptr": "*i32", "cut_ptr": "*i32"},
               ["H", "I", "num_slots", "num_host", "host_off", "top_k", "stride_id", "stride_w", "stride_am",
                "stride_be", "stride_bn", "stride_om", "stride_bias"], [], consts)
    sig["host_off"] = "i64"
    triton.compile(ASTSource(fn=_token_down_kernel, signature=sig, constexprs=consts), target=H100,
                   options={"num_warps": 4, "enable_fp_fusion": False})


@pytest.mark.parametrize("split", [False, True])
def test_handoff_kernels_compile(split):
    """The post (system-scope fence, then the flag) and the bounded device-side wait of hybrid misses."""
    from moestream.kernels.handoff_triton import _collect_kernel, _post_kernel

    consts = {"SPLIT": split, "BLOCK": 1024, "PAIRS": 16}
    sig = _sig({"seq_ptr": "*i32", "hidden_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*fp32", "map_ptr": "*i32",
                "take_ptr": "*i32", "cut_ptr": "*i32", "use_ptr": "*i32", "miss_ptr": "*i32", "pairs_ptr": "*i64", "balance_ptr": "*i32",
                "stamp_ptr": "*i64", "hdr_ptr": "*i32",
                "box_ids_ptr": "*i32", "box_w_ptr": "*fp32", "box_hidden_ptr": "*bf16", "live_ptr": "*i32"},
               ["T", "H", "top_k", "num_slots"], [], consts)
    triton.compile(ASTSource(fn=_post_kernel, signature=sig, constexprs=consts), target=H100, options={"num_warps": 4})
    consts = {"BLOCK": 1024}
    sig = _sig({"seq_ptr": "*i32", "hdr_ptr": "*i32", "rows_ptr": "*fp32", "out_ptr": "*bf16", "error_ptr": "*i32",
                "live_ptr": "*i32", "balance_ptr": "*i32", "stamp_ptr": "*i64"}, ["T", "H", "max_polls"], [], consts)
    triton.compile(ASTSource(fn=_collect_kernel, signature=sig, constexprs=consts), target=H100,
                   options={"num_warps": 4})


@pytest.mark.parametrize("scale", [0, 1, 2])
def test_qk_rope_paged_kernel_compiles(scale):
    from moestream.kernels.norm_rope_triton import _qk_rope_paged_kernel

    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr", "qo_ptr",
                                 "kp_ptr", "vp_ptr")}
    ptrs.update({"tables_ptr": "*i32", "rows_ptr": "*i64", "pos_ptr": "*i64"})
    consts = {"SCALE": scale, "BLOCK_H": 32, "BLOCK_KH": 4, "BLOCK_D": 128, "BS": 16, "USE_PDL": True}
    sig = _sig(ptrs, ["q_heads", "kv_heads", "D", "R", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
                      "stride_vt", "stride_vh", "stride_cos", "stride_table", "stride_block", "stride_pos",
                      "stride_kvh"], ["eps"], consts)
    triton.compile(ASTSource(fn=_qk_rope_paged_kernel, signature=sig, constexprs=consts), target=H100,
                   options={"num_warps": 4})


def test_paged_attention_kernels_compile_with_programmatic_launch():
    from moestream.kernels.paged_attention_triton import _decode_merge_kernel, _decode_split_kernel

    consts = {"G": 8, "G_PAD": 16, "D": 128, "D_PAD": 128, "BS": 16, "TILE": 64, "DOT_PRECISION": "tf32",
              "USE_PDL": True}
    sig = _sig({"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "tables_ptr": "*i32", "lens_ptr": "*i64",
                "o_ptr": "*fp32", "lse_ptr": "*fp32"},
               ["split_len", "stride_qb", "stride_qh", "stride_block", "stride_pos", "stride_kvh", "stride_table",
                "stride_ob", "stride_oh", "stride_os", "stride_lb", "stride_lh"], ["scale"], consts)
    triton.compile(ASTSource(fn=_decode_split_kernel, signature=sig, constexprs=consts), target=H100,
                   options={"num_warps": 4})
    consts = {"D": 128, "D_PAD": 128, "S_TILE": 16, "USE_PDL": True}
    sig = _sig({"o_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16"},
               ["splits", "stride_ob", "stride_oh", "stride_os", "stride_lb", "stride_lh", "stride_outb",
                "stride_outh"], [], consts)
    triton.compile(ASTSource(fn=_decode_merge_kernel, signature=sig, constexprs=consts), target=H100,
                   options={"num_warps": 4})


@pytest.mark.parametrize("residual", [False, True])
def test_norm_and_router_kernels_compile_with_programmatic_launch(residual):
    from moestream.kernels.norm_rope_triton import _rms_norm_kernel
    from moestream.kernels.router_topk_triton import _router_topk_kernel

    consts = {"HAS_RESIDUAL": residual, "SCALE": 1, "BLOCK_D": 2048, "USE_PDL": True}
    sig = _sig({n: "*bf16" for n in ("x_ptr", "res_ptr", "res_out_ptr", "w_ptr", "out_ptr")},
               ["D", "stride_x", "stride_res", "stride_out"], ["eps"], consts)
    triton.compile(ASTSource(fn=_rms_norm_kernel, signature=sig, constexprs=consts), target=H100,
                   options={"num_warps": 4})
    consts = {"K": 8, "MODE": 0, "RENORMALISE": True, "BLOCK_E": 128, "BLOCK_K": 8, "USE_PDL": True}
    sig = _sig({"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64"}, ["E", "stride"], [], consts)
    triton.compile(ASTSource(fn=_router_topk_kernel, signature=sig, constexprs=consts), target=H100,
                   options={"num_warps": 4})


def test_uniform_router_kernel_compiles():
    """Benchmark routing's one launch: uniform draws from a device counter, the router's weights."""
    from moestream.kernels.router_topk_triton import _uniform_topk_kernel

    consts = {"K": 8, "BLOCK_E": 128, "BLOCK_K": 8, "USE_PDL": True}
    sig = _sig({"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64", "draws_ptr": "*i64"},
               ["E", "stride", "seed"], [], consts)
    triton.compile(ASTSource(fn=_uniform_topk_kernel, signature=sig, constexprs=consts), target=H100,
                   options={"num_warps": 4})


def test_split_slots_kernel_compiles():
    """The quantized host reads' split of a call's slots between the CPU and the device, one launch."""
    from moestream.kernels.fused_moe_quant_triton import _split_slots_kernel

    consts = {"PAIRS": 16}
    sig = _sig({"slot_ptr": "*i32", "take_ptr": "*i32", "out_ptr": "*i32"}, ["n", "top_k", "num_slots"], [], consts)
    triton.compile(ASTSource(fn=_split_slots_kernel, signature=sig, constexprs=consts), target=H100,
                   options={"num_warps": 4})


TOKEN_FORMATS = [(4, 64, False), (8, 32, False), (2, 32, False), (4, 64, True)]


@pytest.mark.parametrize("bits,group,nf,reduce,split",
                         [(*fmt, reduce, reduce == (i % 2 == 0)) for i, fmt in enumerate(TOKEN_FORMATS) for reduce in (True, False)])
def test_quant_token_kernels_compile(bits, group, nf, reduce, split):
    """One token's quantized experts: the packed words unpacked by planes, for each format the path serves."""
    from moestream.kernels.fused_moe_token_quant import (QUANT_TOKEN_CONFIG, planes_kernel, _qtoken_down_kernel,
                                                          _qtoken_gate_up_kernel)

    consts = {"BITS": bits, "NF": nf, "GROUP": group, "SUMS": False, "BLOCK": 1024, "USE_PDL": True}
    sig = _sig({"x_ptr": "*bf16", "out_ptr": "*fp32", "sums_ptr": "*fp32"}, ["H"], [], consts)
    triton.compile(ASTSource(fn=planes_kernel, signature=sig, constexprs=consts), target=H100, options={"num_warps": 4})

    quant = {"q_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "code_ptr": "*fp32" if nf else "*bf16"}
    ids = {"ids_ptr": "*i32", "map_ptr": "*i32", "take_ptr": "*i32", "cut_ptr": "*i32"}
    tile = QUANT_TOKEN_CONFIG.gate_up
    consts = {"HAS_MAP": True, "ACTIVATION": 0, "BITS": bits, "GROUP": group, "NF": nf, "BLOCK_N": tile.block_n,
              "BLOCK_K": tile.block_k, "EVEN_K": True, "SPLIT": split, "K_PAD": 8, "OUT_DTYPE": triton.language.bfloat16,
              "USE_PDL": True}
    sig = _sig({"x_ptr": "*fp32", **quant, "c_ptr": "*fp32", **ids},
               ["I", "H", "num_slots", "num_host", "host_q", "host_s", "host_z", "top_k", "stride_id", "stride_qe",
                "stride_qn", "stride_se", "stride_sn", "stride_cm"], [], consts)
    sig.update(host_q="i64", host_s="i64", host_z="i64")   # host stacks sit far from the slots
    triton.compile(ASTSource(fn=_qtoken_gate_up_kernel, signature=sig, constexprs=consts), target=H100,
                   options={"num_warps": tile.num_warps})
    tile = QUANT_TOKEN_CONFIG.down
    consts = {"HAS_MAP": True, "REDUCE": reduce, "K_PAD": 8, "BITS": bits, "GROUP": group, "NF": nf,
              "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k, "EVEN_K": False, "SPLIT": split, "USE_PDL": True}
    sig = _sig({"a_ptr": "*fp32", **quant, "out_ptr": "*bf16" if reduce else "*fp32", "ids_ptr": "*i32",
                "map_ptr": "*i32", "w_ptr": "*fp32", "take_ptr": "*i32", "cut_ptr": "*i32"},
               ["H", "I", "num_slots", "num_host", "host_q", "host_s", "host_z", "top_k", "stride_id", "stride_w",
                "stride_am", "stride_qe", "stride_qn", "stride_se", "stride_sn", "stride_om"], [], consts)
    sig.update(host_q="i64", host_s="i64", host_z="i64")
    kernel = triton.compile(ASTSource(fn=_qtoken_down_kernel, signature=sig, constexprs=consts), target=H100,
                            options={"num_warps": tile.num_warps, "enable_fp_fusion": False})
    assert kernel.metadata.shared <= SMEM


@pytest.mark.parametrize("bits,group,nf,bias", [(*fmt, i % 2 == 1) for i, fmt in enumerate(TOKEN_FORMATS)])
def test_quant_gemv_kernels_compile(bits, group, nf, bias):
    """The one-row quantized GEMV at each of its default tiles: the prepare launch (the planes with the
    group sums) and the product."""
    from moestream.kernels.fused_moe_token_quant import planes_kernel
    from moestream.kernels.quant_gemv_triton import _quant_gemv_kernel, default_tile
    from moestream.quant import QuantSpec

    consts = {"BITS": bits, "NF": nf, "GROUP": group, "SUMS": not nf, "BLOCK": 1024, "USE_PDL": True}
    sig = _sig({"x_ptr": "*bf16", "out_ptr": "*fp32", "sums_ptr": "*fp32"}, ["H"], [], consts)
    triton.compile(ASTSource(fn=planes_kernel, signature=sig, constexprs=consts), target=H100, options={"num_warps": 4})
    spec = QuantSpec("nf" if nf else "int", bits, group)
    for N, K in ((5120, 2048), (2048, 4096), (151936, 2048)):
        tile = default_tile(N, K, spec)
        consts = {"HAS_BIAS": bias, "BITS": bits, "GROUP": group, "NF": nf, "BLOCK_N": tile.block_n,
                  "BLOCK_K": tile.block_k, "EVEN_K": False, "USE_PDL": True}
        sig = _sig({"planes_ptr": "*fp32", "sums_ptr": "*fp32", "q_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16",
                    "code_ptr": "*fp32" if nf else "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16"},
                   ["N", "K", "stride_qn", "stride_sn"], [], consts)
        kernel = triton.compile(ASTSource(fn=_quant_gemv_kernel, signature=sig, constexprs=consts), target=H100,
                                options={"num_warps": tile.num_warps})
        assert kernel.metadata.shared <= SMEM


@pytest.mark.parametrize("logits", ["*bf16", "*fp32"])
def test_sampling_kernels_compile(logits):
    """The top-k draw's two launches at the largest candidate set they take."""
    from moestream.kernels.sampling_triton import CHUNK, MAX_CANDIDATES, _candidates_kernel, _draw_kernel

    consts = {"CHUNK_": CHUNK, "USE_PDL": True}
    sig = _sig({"logits_ptr": logits, "keys_ptr": "*i64"}, ["V", "k", "stride_l", "stride_k"], [], consts)
    triton.compile(ASTSource(fn=_candidates_kernel, signature=sig, constexprs=consts), target=H100,
                   options={"num_warps": 4})
    consts = {"N_PAD": MAX_CANDIDATES, "K_PAD": 128, "USE_PDL": True}
    sig = _sig({"keys_ptr": "*i64", "uniform_ptr": "*fp32", "out_ptr": "*i64"}, ["n", "k", "stride_k"],
               ["temperature", "top_p", "min_p"], consts)
    kernel = triton.compile(ASTSource(fn=_draw_kernel, signature=sig, constexprs=consts), target=H100,
                            options={"num_warps": 8})
    assert kernel.metadata.shared <= SMEM
