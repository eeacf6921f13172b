"""The CPU expert kernel (kernels/cpu_moe.c) computes `moe_reference`'s sum for the pairs it is given.

fp32 weights: equal to the reference to rounding. bf16 weights: equal to the same math carried out
in fp32 on the bf16 values, with the activation rounded to bf16 before the down product (what the
kernel and the GPU kernel do); the reference's bf16 GEMM rounds its gate_up product too, so it is
only close to that."""

import pytest
import torch

from moestream.kernels import cpu_moe
from moestream.kernels.moe_reference import Activation, get_activation, moe_reference

ACTIVATIONS = ["swiglu", Activation("swiglu_clamped", 1.702, 7.0), "geglu_tanh"]

pytestmark = pytest.mark.skipif(cpu_moe.load() is None, reason=f"no C compiler here: {cpu_moe.unavailable_reason()}")


def _experts(S, H, I, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = {"gate_up": torch.randn(S, 2 * I, H, generator=g).to(dtype) / H ** 0.5,
             "down": torch.randn(S, H, I, generator=g).to(dtype) / I ** 0.5}
    if bias:
        slots.update(gate_up_bias=torch.randn(S, 2 * I, generator=g).to(dtype),
                     down_bias=torch.randn(S, H, generator=g).to(dtype))
    return slots


def _bf16_math(x, slots, ids, w, activation):
    """The kernel's arithmetic on bf16 values, in fp32: fp32 products and sums, activation to bf16."""
    act = get_activation(activation)
    out = torch.zeros(x.shape[0], slots["gate_up"].shape[2], dtype=torch.float32)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = slots["gate_up"][e].float() @ x[t].float()
            if "gate_up_bias" in slots:
                h = h + slots["gate_up_bias"][e].float()
            a = act(h[None])[0].to(torch.bfloat16).float()
            y = slots["down"][e].float() @ a
            if "down_bias" in slots:
                y = y + slots["down_bias"][e].float()
            out[t] += w[t, j] * y
    return out


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("H, I", [(64, 48), (96, 40)])   # K a multiple of 32 and not (vector tails)
def test_fp32_equals_the_reference(activation, bias, H, I):
    S, T, k = 7, 6, 3
    slots = _experts(S, H, I, torch.float32, bias)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(-1, S, (T, k), generator=g, dtype=torch.int32)
    w = torch.rand(T, k, generator=g)
    ref = moe_reference(x, slots["gate_up"], slots["down"], ids, w, activation,
                        slots.get("gate_up_bias"), slots.get("down_bias"))
    out = cpu_moe.cpu_moe(x, slots, ids, w, activation)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("T", [1, 3, 70])   # decode, a partial token tile, more pairs than one pass holds
def test_bf16_is_the_fp32_math_on_bf16_values(activation, T):
    S, H, I, k = 5, 128, 64, 2
    slots = _experts(S, H, I, torch.bfloat16, bias=True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, S, (T, k), generator=g, dtype=torch.int32)
    w = torch.rand(T, k, generator=g)
    out = cpu_moe.cpu_moe(x, slots, ids, w, activation, out_dtype=torch.float32)
    want = _bf16_math(x, slots, ids, w, activation)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    ref = moe_reference(x, slots["gate_up"], slots["down"], ids, w, activation,
                        slots["gate_up_bias"], slots["down_bias"]).float()
    assert (out - ref).abs().max() <= 0.05 * ref.abs().max()


def test_pairs_marked_minus_one_and_unrouted_tokens_add_nothing():
    slots = _experts(4, 64, 32, torch.float32, bias=True)
    x = torch.randn(3, 64)
    ids = torch.tensor([[-1, -1], [2, -1], [-1, -1]], dtype=torch.int32)
    out = cpu_moe.cpu_moe(x, slots, ids, torch.ones(3, 2))
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[2]) == 0
    assert torch.count_nonzero(out[1]) > 0


def test_the_thread_team_can_be_resized():
    slots = _experts(3, 64, 32, torch.bfloat16, bias=False)
    x = torch.randn(2, 64).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    w = torch.rand(2, 2)
    try:
        assert cpu_moe.set_threads(1) == 1
        one = cpu_moe.cpu_moe(x, slots, ids, w)
        assert cpu_moe.set_threads(2) == 2
        two = cpu_moe.cpu_moe(x, slots, ids, w)
    finally:
        cpu_moe.set_threads()
    torch.testing.assert_close(one, two, rtol=0, atol=0)   # rows are owned by one thread: same sums


def test_the_default_team_leaves_one_core_and_stops_at_sixteen():
    """A larger team only waits longer on its slowest thread (31 of 32 cores decoded 3x slower than 8)."""
    assert [cpu_moe.default_threads(n) for n in (1, 2, 16, 17, 32, 64, 192)] == [1, 1, 15, 16, 16, 16, 16]


def test_ranks_on_one_host_get_disjoint_shares_of_its_cores():
    cpus = list(range(1, 65))
    shares = [cpu_moe.cpu_share(cpus, i, 4) for i in range(4)]
    assert [len(s) for s in shares] == [16, 16, 16, 16]
    assert sorted(sum(shares, [])) == cpus                           # disjoint and covering
    assert [len(cpu_moe.cpu_share(cpus[:10], i, 3)) for i in range(3)] == [3, 3, 4]   # the last takes the rest
    assert [cpu_moe.cpu_share([0, 1], i, 4) for i in range(4)] == [[0], [1], [0], [1]]   # fewer cores than ranks
    assert cpu_moe.cpu_share(cpus, 0, 1) == cpus
    try:
        cpu_moe.use_share(1, 2)
        mine = cpu_moe.usable_cpus()
        cpu_moe.use_share(0, 2)
        assert not set(mine) & set(cpu_moe.usable_cpus())
    finally:
        cpu_moe.use_share(0, 1)


def _quantized_experts(S, H, I, spec, seed=0):
    from moestream.quant import quantize

    g = torch.Generator().manual_seed(seed)
    slots = {}
    for proj, (n, k) in {"gate_up": (2 * I, H), "down": (H, I)}.items():
        parts = [quantize(torch.randn(n, k, generator=g) / k ** 0.5, spec).parts() for _ in range(S)]
        for part in parts[0]:
            slots[f"{proj}.{part}"] = torch.stack([p[part] for p in parts]).contiguous()
    return slots


def _spec(name):
    """`int4-g32`, or `int4-g32:fp32` for fp32 scales and biases (asymmetric GPTQ / AWQ repacked), `:fp16`
    for fp16 ones (GGUF's Q4_0 and Q8_0, symmetric GPTQ)."""
    from moestream.quant import parse_quant

    base, _, scales = name.partition(":")
    return parse_quant(base, {"": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[scales])


def _assert_fp32_equals_the_reference(slots, spec, H: int):
    """Four fp32 tokens (unrouted slots among their ids) through the kernel and through the reference's
    dequantize-then-multiply; returns the inputs for further checks."""
    from moestream.kernels.quant_moe_reference import quant_moe_reference

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, H, generator=g)
    ids = torch.randint(-1, 5, (4, 3), generator=g, dtype=torch.int32)
    w = torch.rand(4, 3, generator=g)
    ref = quant_moe_reference(x, slots, ids, w, spec)
    torch.testing.assert_close(cpu_moe.cpu_moe_quant(x, slots, ids, w, spec), ref, rtol=1e-5, atol=1e-5)
    return x, ids, w


@pytest.mark.parametrize("name", ["int4-g64", "int4-g32", "int4-g128", "int8-g64", "int2-g32", "nf4-g64",
                                  "int4-g32:fp32", "int8-g128:fp32", "int2-g32:fp32", "int4-g32:fp16", "int8-g32:fp16"])
@pytest.mark.parametrize("H, I", [(128, 64), (96, 40)])   # whole groups, and a ragged last group
def test_quantized_fp32_equals_the_reference(name, H, I):
    """The packed values unpacked in registers (the vector path where a group fills whole 16-byte
    loads, the portable one elsewhere) give the reference's dequantize-then-multiply result."""
    spec = _spec(name)
    assert cpu_moe.supports_quant(spec)
    _assert_fp32_equals_the_reference(_quantized_experts(5, H, I, spec), spec, H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["int8-g32:fp16", "int4-g32:fp16", "int4-g64", "fp8-b128x128", "nf4-g64", "mxfp4"])
def test_a_tokens_quantized_result_is_the_same_alone_and_beside_others(name, dtype):
    """A row meets several tokens at once (its codes unpacked once for all of them): each token's sums
    stay its own, in one token's order, so its output has the same bits in a call of 1 token or 7
    (every token routed to the same experts: rows of 1, 2, 4 tokens and the remainders). bf16 inputs
    take the 4-bit rows' bf16 dot products where the CPU has them."""
    from moestream.quant.fp8 import parse_fp8

    from moestream.quant.mxfp4 import MXFP4

    fp8 = parse_fp8(name)
    spec = MXFP4 if name == "mxfp4" else fp8 or _spec(name)
    H, I = 256, 128
    if name == "mxfp4":   # the experts' biases in the hidden rows' dtype
        slots = {n: t.to(dtype) if t.is_floating_point() else t for n, t in _mxfp4_experts(4, H, I, seed=2).items()}
    else:
        slots = _fp8_experts(4, H, I, spec, seed=2) if fp8 else _quantized_experts(4, H, I, spec)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, H, generator=g).to(dtype)
    ids = torch.tensor([[0, 2]] * 7, dtype=torch.int32)
    w = torch.rand(7, 2, generator=g)
    together = cpu_moe.cpu_moe_quant(x, slots, ids, w, spec, out_dtype=torch.float32)
    alone = torch.cat([cpu_moe.cpu_moe_quant(x[t:t + 1], slots, ids[t:t + 1], w[t:t + 1], spec, out_dtype=torch.float32)
                       for t in range(7)])
    assert torch.equal(together, alone)


def test_fp16_scales_read_as_torch_reads_them_subnormal_and_negative_too():
    """The kernel widens fp16 scales and biases itself: every kind of half (subnormal, normal, negative,
    zero) gives the reference's weights, which torch widens."""
    spec = _spec("int4-g32:fp16")
    H, I = 128, 64
    slots = _quantized_experts(5, H, I, spec)
    halves = torch.tensor([2.0 ** -24, 3 * 2.0 ** -20, -(2.0 ** -15), 6.1e-5, -0.75, 0.0, 0.125, -3e-3],
                          dtype=torch.float16)
    for part in ("gate_up.scales", "gate_up.biases", "down.scales", "down.biases"):
        t = slots[part]
        picks = torch.randint(0, len(halves), t.shape, generator=torch.Generator().manual_seed(len(part)))
        slots[part] = (halves[picks] * (1 / 64 if part.endswith("biases") else 1)).contiguous()
    assert (slots["gate_up.scales"].abs() < 6.1e-5).any()   # subnormal halves among them
    from moestream.kernels.quant_moe_reference import quant_moe_reference

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, H, generator=g), torch.rand(4, 3, generator=g)
    ids = torch.randint(-1, 5, (4, 3), generator=g, dtype=torch.int32)
    ref = quant_moe_reference(x, slots, ids, w, spec)
    got = cpu_moe.cpu_moe_quant(x, slots, ids, w, spec)
    # weights of mixed magnitudes cancel in the sums: fp32 summation orders differ by ~1e-5 of the whole
    assert float((got - ref).norm() / ref.norm()) < 1e-5


def test_quantized_slots_on_the_cpu_device_go_through_the_kernel_in_pair_rows(monkeypatch):
    """A CPU engine's quantized experts (resident or staged) take the C kernel, not the reference's
    dequantize-every-call; its pair rows summed in the reference's order are the call's result, so a
    bounded bank's calls add up to one call's bits."""
    from moestream.experts.format import QuantizedFormat
    from moestream.kernels.moe_reference import sum_pairs_reference
    from moestream.kernels.quant_moe_reference import quant_moe_reference

    spec, H, I = _spec("int4-g32:fp16"), 128, 64
    slots = _quantized_experts(5, H, I, spec)
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(6, H, generator=g), torch.rand(6, 3, generator=g)
    ids = torch.randint(-1, 5, (6, 3), generator=g)
    calls = []
    pairs_fn = cpu_moe.cpu_moe_quant_pairs
    monkeypatch.setattr(cpu_moe, "cpu_moe_quant_pairs", lambda *a: calls.append(1) or pairs_fn(*a))
    dispatch = QuantizedFormat(spec, torch.float32).dispatch(torch.device("cpu"))
    out, pairs = dispatch(x, slots, ids, w), dispatch(x, slots, ids, w, reduce=False)
    assert len(calls) == 2 and pairs.shape == (6, 3, H)
    assert torch.equal(pairs[ids < 0], torch.zeros_like(pairs[ids < 0]))
    assert torch.equal(sum_pairs_reference(pairs, x.dtype), out)
    torch.testing.assert_close(out, quant_moe_reference(x, slots, ids, w, spec), rtol=1e-5, atol=1e-5)
    first, rest = ids.clone(), ids.clone()   # two calls over disjoint slots sum to one call's bits
    first[first >= 3], rest[rest < 3] = -1, -1
    assert torch.equal(sum_pairs_reference(dispatch(x, slots, first, w, reduce=False)
                                           + dispatch(x, slots, rest, w, reduce=False), x.dtype), out)


def test_quantized_specs_the_kernel_does_not_read_are_named():
    from moestream.quant import parse_quant

    assert not cpu_moe.supports_quant(parse_quant("int3"))      # 3-bit packs straddle bytes
    assert not cpu_moe.supports_quant(parse_quant("nf3"))


@pytest.mark.parametrize("name", ["int4-g64", "int4-g128", "int4-g128:fp32", "int4-g32", "int4-g32:fp32",
                                  "int4-g32:fp16"])
def test_affine_4bit_with_bf16_inputs_takes_bf16_dot_products(name, monkeypatch):
    """bf16 hidden rows meet affine 4-bit rows through bf16 dot products of the codes (exact
    products, fp32 sums) and the group sums of the inputs: the result of the fp32 path, to fp32's
    rounding."""
    spec = _spec(name)
    H, I = 256, 128
    slots = _quantized_experts(6, H, I, spec, seed=1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, 6, (3, 4), generator=g, dtype=torch.int32)
    w = torch.rand(3, 4, generator=g)
    assert cpu_moe._q4_bf16(spec, x, H, I)
    fast = cpu_moe.cpu_moe_quant(x, slots, ids, w, spec, out_dtype=torch.float32)
    monkeypatch.setattr(cpu_moe, "_q4_bf16", lambda *a: False)
    plain = cpu_moe.cpu_moe_quant(x, slots, ids, w, spec, out_dtype=torch.float32)
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)
    assert not torch.equal(fast, torch.zeros_like(fast))


def test_the_stream_worker_answers_every_post_when_most_have_no_cpu_work():
    """Posts whose pairs are all in the bank are answered by the worker's first thread alone; the
    team must still take every later job together. Twice as many team threads as cores, so some are
    descheduled while posts come quickly: a team thread left behind by an empty post once ran a job
    twice and deadlocked the team (answers stopped and `close` never returned)."""
    E, H, I, k = 6, 64, 48, 2
    stack = _experts(E, H, I, torch.float32, bias=False, seed=3)
    box = cpu_moe.Mailbox(k, H, max_tokens=1, dtype=torch.float32, pin=False)
    threads = 2 * len(cpu_moe.usable_cpus()) + 2
    worker = cpu_moe.StreamWorker({0: stack}, {0: box}, top_k=k, max_tokens=1, threads=threads)
    g = torch.Generator().manual_seed(4)
    try:
        for seq in range(1, 401):
            cpu_side = seq % 4 == 0   # three posts in four have nothing for the CPU (the bank serves them: -1)
            ids = torch.randperm(3, generator=g)[:k].to(torch.int32)
            x, w = torch.randn(1, H, generator=g), torch.rand(1, k, generator=g)
            box.ids[:k].copy_(ids if cpu_side else torch.full_like(ids, -1))
            box.weights[:k].copy_(w[0])
            box.hidden[:H].copy_(x[0])
            box.post[1], box.post[2], box.post[3] = 1, -1, 0
            cpu_moe.publish(box.post, seq)
            assert cpu_moe.wait_answer(box.result, seq, timeout_s=20.0), f"post {seq} was not answered"
            assert int(box.result[1]) == (k if cpu_side else 0)
            if cpu_side:
                want = moe_reference(x, stack["gate_up"], stack["down"], ids[None], w, "swiglu")
                torch.testing.assert_close(box.rows[:H].view(1, H), want, rtol=1e-5, atol=1e-5)
    finally:
        worker.close()
    assert box.served()[1] == 400


def _cpu_part(x, stack, ids, w, take, cut):
    """The CPU's rows of a split one-token post, in fp32: the first `take` pairs whole, then the
    intermediate rows [0, cut) of the next pair."""
    gate_up, down = stack["gate_up"], stack["down"]
    I = down.shape[-1]
    out = moe_reference(x, gate_up, down, ids[None, :take], w[:, :take], "swiglu") if take else torch.zeros_like(x)
    if 0 < cut < I and take < ids.numel():
        e = int(ids[take])
        g = x @ gate_up[e, :cut].T
        u = x @ gate_up[e, I:I + cut].T
        out = out + w[0, take] * ((torch.nn.functional.silu(g) * u) @ down[e, :, :cut].T)
    return out


@pytest.mark.parametrize("threads", [1, 5])
def test_the_stream_worker_computes_whole_pairs_and_a_cut_one(threads):
    """A split post: the worker computes the first `take` of the pairs outside the bank and the
    intermediate rows [0, cut) of the next, at every take and at cuts inside and across the
    kernel's row tasks, on a team whose threads share the rows unevenly."""
    E, H, I, k = 6, 64, 48, 4
    stack = _experts(E, H, I, torch.float32, bias=False, seed=5)
    box = cpu_moe.Mailbox(k, H, max_tokens=1, dtype=torch.float32, pin=False)
    worker = cpu_moe.StreamWorker({0: stack}, {0: box}, top_k=k, max_tokens=1, threads=threads)
    g = torch.Generator().manual_seed(6)
    seq = 0
    try:
        for take in range(k):
            for cut in (0, 5, 16, 20, 47):
                seq += 1
                ids = torch.randperm(E, generator=g)[:k].to(torch.int32)
                x, w = torch.randn(1, H, generator=g), torch.rand(1, k, generator=g)
                box.ids[:k].copy_(ids)
                box.weights[:k].copy_(w[0])
                box.hidden[:H].copy_(x[0])
                box.post[1], box.post[2], box.post[3] = 1, take, cut
                cpu_moe.publish(box.post, seq)
                assert cpu_moe.wait_answer(box.result, seq, timeout_s=20.0), f"post {seq} was not answered"
                want = _cpu_part(x, stack, ids, w, take, cut)
                torch.testing.assert_close(box.rows[:H].view(1, H), want, rtol=1e-5, atol=1e-5)
    finally:
        worker.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_prefetch_distance_changes_no_result(dtype):
    """Prefetching only asks for lines early: every distance, none included, gives the same bits."""
    E, H, I, T, k = 6, 128, 64, 3, 2
    stack = _experts(E, H, I, dtype, bias=False, seed=8)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=g)
    outs = []
    try:
        for nbytes in (0, 64, 2048, 1 << 20):
            cpu_moe.set_prefetch(nbytes)
            outs.append(cpu_moe.cpu_moe(x, stack, ids, w, out_dtype=torch.float32))
    finally:
        cpu_moe.set_prefetch(None)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    torch.testing.assert_close(outs[0], moe_reference(x.float(), stack["gate_up"].float(), stack["down"].float(), ids, w,
                                                      "swiglu"), rtol=2e-2, atol=2e-2)


# ---- experts read as FP8 and MXFP4 checkpoints store them -----------------------------------------

FP8_CASES = {   # format, H, I
    "b12x12": ("fp8-b12x12", 96, 40),         # ragged: the gate's last block 4 rows of 12, down's last 4 columns
    "b16x16": ("fp8-b16x16", 128, 64),        # whole 16-byte groups (the vector path, where the CPU has one)
    "b128x128": ("fp8-b128x128", 256, 128),   # DeepSeek-V3's blocks, two along the hidden size
    "channel": ("fp8-channel", 96, 40),
    "tensor": ("fp8-tensor", 128, 64),
}


def _fp8_experts(S, H, I, spec, seed=0, codes=None):
    """S random experts as `Fp8Format` holds them: e4m3 bytes (every code but the two NaNs, subnormals
    included, or those of `codes`) and float32 scales on the format's grids."""
    from moestream.experts.format import ExpertShape, Fp8Format

    g = torch.Generator().manual_seed(seed)
    slots = {}
    for t in Fp8Format(spec, torch.float32).tensors(ExpertShape(H, I)):
        if t.name.endswith(".qweight"):
            if codes is None:
                q = torch.randint(0, 254, (S, *t.shape), generator=g)
                q = torch.where(q >= 0x7F, q + 1, q)   # 0x7f and 0xff are NaN
            else:
                q = codes[torch.randint(0, len(codes), (S, *t.shape), generator=g)]
            slots[t.name] = q.to(torch.uint8)
        else:   # a value's magnitude reaches 448: scales that keep the rows' sums near 1
            k = H if t.name.startswith("gate_up") else I
            slots[t.name] = torch.rand(S, *t.shape, generator=g) / (100 * k ** 0.5) + 1e-4
    return slots


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_fp8_experts_equal_the_reference(case):
    """FP8 experts as stored (e4m3 bytes decoded from their bits in registers, each block's scale read
    from the grid, gate_up's two grids apart) give `quant_moe_reference`'s dequantize-then-multiply."""
    from moestream.kernels.quant_moe_reference import quant_moe_reference
    from moestream.quant.fp8 import parse_fp8

    name, H, I = FP8_CASES[case]
    spec = parse_fp8(name)
    assert cpu_moe.supports_quant(spec)
    slots = _fp8_experts(5, H, I, spec)
    x, ids, w = _assert_fp32_equals_the_reference(slots, spec, H)
    xb = x.to(torch.bfloat16)   # bf16 rows: the activation rounded to bf16, the weights not (the reference rounds them)
    out = cpu_moe.cpu_moe_quant(xb, slots, ids, w, spec, out_dtype=torch.float32)
    ref = quant_moe_reference(xb, slots, ids, w, spec).float()
    assert (out - ref).abs().max() <= 0.03 * ref.abs().max()


@pytest.mark.parametrize("block,scale", [(16, 64.0), (32, 64.0), (32, 1024.0)])
def test_fp8_subnormal_and_nan_codes_read_as_e4m3_defines_them(block, scale):
    """Subnormal codes (exponent bits 0) keep their value (denormals are not flushed), and the NaN
    codes make the rows they reach NaN, as the reference's float8_e4m3fn conversion does. Blocks of 32
    take the byte-coded rows' own loop; a scale of 2^10 cannot hold the codes' 2^120 (it would overflow),
    so their sums take it."""
    from moestream.kernels.quant_moe_reference import quant_moe_reference
    from moestream.quant.fp8 import Fp8Spec

    spec, H, I = Fp8Spec(block, block), 64, 32
    subnormal = torch.tensor([*range(0x01, 0x08), *range(0x81, 0x88)])
    slots = _fp8_experts(3, H, I, spec, seed=4, codes=subnormal)
    for name in ("gate_up.scales", "down.scales"):
        slots[name] = torch.full_like(slots[name], scale)   # subnormal values are at most 2^-6 · 7/8
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    w = torch.rand(2, 2, generator=torch.Generator().manual_seed(6))
    ref = quant_moe_reference(x, slots, ids, w, spec)
    out = cpu_moe.cpu_moe_quant(x, slots, ids, w, spec)
    assert ref.abs().max() > 0.1 and (out - ref).abs().max() <= 1e-4 * ref.abs().max()   # flushed: all zeros
    slots["down.qweight"][2, 5, 3] = 0xFF   # expert 2's output row 5: NaN
    out = cpu_moe.cpu_moe_quant(x, slots, ids, w, spec)
    assert out[1, 5].isnan() and not out[1, :5].isnan().any() and not out[0].isnan().any()


def _mxfp4_experts(S, H, I, seed=0):
    """S random experts as `Mxfp4Format` holds them: random fp4 code bytes, e8m0 scales near 2^-3,
    and the experts' biases."""
    from moestream.experts.format import ExpertShape
    from moestream.experts.mxfp4_format import Mxfp4Format

    g = torch.Generator().manual_seed(seed)
    slots = {}
    for t in Mxfp4Format(torch.float32).tensors(ExpertShape(H, I, bias=True)):
        if t.name.endswith(".blocks"):
            slots[t.name] = torch.randint(0, 256, (S, *t.shape), generator=g, dtype=torch.uint8)
        elif t.name.endswith(".scales"):
            slots[t.name] = torch.randint(119, 125, (S, *t.shape), generator=g, dtype=torch.uint8)
        else:
            slots[t.name] = torch.randn(S, *t.shape, generator=g)
    return slots


@pytest.mark.parametrize("activation", ["swiglu", Activation("swiglu_clamped", 1.702, 7.0)], ids=str)
@pytest.mark.parametrize("H, I", [(64, 32), (96, 160)])
def test_mxfp4_experts_equal_the_reference(activation, H, I):
    """MXFP4 experts as stored (e2m1 codes through the code table, low nibble first, one e8m0 scale per
    32 values, the experts' biases and gpt-oss's clamped SwiGLU) give `mxfp4_moe_reference`."""
    from moestream.kernels.mxfp4_moe import mxfp4_moe_reference
    from moestream.quant.mxfp4 import MXFP4

    assert cpu_moe.supports_quant(MXFP4)
    slots = _mxfp4_experts(6, H, I)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, H, generator=g)
    ids = torch.randint(-1, 6, (5, 4), generator=g, dtype=torch.int32)
    w = torch.rand(5, 4, generator=g)
    ref = mxfp4_moe_reference(x, slots, ids, w, activation)
    out = cpu_moe.cpu_moe_quant(x, slots, ids, w, MXFP4, activation=activation)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8-b12x12", "fp8-tensor", "mxfp4"])
def test_the_stream_worker_reads_fp8_and_mxfp4_experts(fmt, dtype):
    """The worker serves posts from FP8 and MXFP4 host stacks (each layer's layout handed over in its
    `QuantLayout`; MXFP4 with the experts' biases, in the hidden rows' dtype, and the clamped SwiGLU)
    as the direct call does; in bf16 that is the reference to bf16's rounding."""
    from moestream.kernels.mxfp4_moe import mxfp4_moe_reference
    from moestream.kernels.quant_moe_reference import quant_moe_reference
    from moestream.quant.fp8 import parse_fp8
    from moestream.quant.mxfp4 import MXFP4

    E, H, I, k, T = 6, 96, 64, 3, 2
    if fmt == "mxfp4":
        spec, stack, act = MXFP4, _mxfp4_experts(E, H, I, seed=8), Activation("swiglu_clamped", 1.702, 7.0)
        stack = {n: t.to(dtype) if t.is_floating_point() else t for n, t in stack.items()}
        reference = lambda x, ids, w: mxfp4_moe_reference(x, stack, ids, w, act)   # noqa: E731
    else:
        spec, act = parse_fp8(fmt), Activation("swiglu")
        stack = _fp8_experts(E, H, I, spec, seed=8)
        reference = lambda x, ids, w: quant_moe_reference(x, stack, ids, w, spec)   # noqa: E731
    box = cpu_moe.Mailbox(k, H, max_tokens=T, dtype=dtype, pin=False)
    worker = cpu_moe.StreamWorker({0: stack}, {0: box}, top_k=k, max_tokens=T, activation=act, threads=2,
                                  specs={0: spec})
    g = torch.Generator().manual_seed(9)
    try:
        for seq in (1, 2):
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
            x, w = torch.randn(T, H, generator=g).to(dtype), torch.rand(T, k, generator=g)
            box.ids[:T * k].copy_(ids.view(-1))
            box.weights[:T * k].copy_(w.view(-1))
            box.hidden[:T * H].copy_(x.view(-1))
            box.post[1], box.post[2], box.post[3] = T, -1, 0
            cpu_moe.publish(box.post, seq)
            assert cpu_moe.wait_answer(box.result, seq, timeout_s=20.0), f"post {seq} was not answered"
            assert int(box.result[1]) == T * k
            rows = box.rows[:T * H].view(T, H)
            want = cpu_moe.cpu_moe_quant(x, stack, ids, w, spec, out_dtype=torch.float32, activation=act)
            torch.testing.assert_close(rows, want, rtol=1e-6, atol=1e-6)
            ref = reference(x, ids, w).float()
            assert (rows - ref).abs().max() <= (1e-5 if dtype == torch.float32 else 0.03) * ref.abs().max()
    finally:
        worker.close()


@pytest.mark.parametrize("name", ["int4-g32:fp16", "int8-g32:fp16", "int4-g128", "nf4-g64", "int2-g32:fp32",
                                  "int4-g64:fp32", "fp8-b16x16", "fp8-b12x12", "fp8-channel", "fp8-b128x128"])
@pytest.mark.parametrize("K", [128, 96])   # whole groups, and a ragged last group (or block)
def test_a_quantized_linear_reads_its_rows_in_place_for_a_decode_steps_tokens(name, K, monkeypatch):
    """`kernels.quant_linear` on the CPU: up to QLINEAR_MAX_TOKENS inputs go through the C kernel's row dot
    products (the weight never dequantized into memory), with the reference's product in fp32 and its bias
    added; more inputs take the reference's dequantize-then-GEMM."""
    from moestream import kernels
    from moestream.kernels.quant_linear_reference import quant_linear_reference
    from moestream.quant import quantize
    from moestream.quant.fp8 import parse_fp8, quantize_fp8

    g = torch.Generator().manual_seed(K)
    w, bias = torch.randn(72, K, generator=g), torch.randn(72, generator=g)
    fp8 = parse_fp8(name)
    if fp8 is not None and K % 16 and fp8.block_k == 16:
        pytest.skip("fp8-b16x16 needs whole blocks")
    spec = fp8 or _spec(name)
    assert cpu_moe.supports_quant(spec)
    if fp8 is not None:
        values, scales = quantize_fp8(w, spec)
        qweight, biases = values.view(torch.uint8), None   # the e4m3 bits, as `QuantLinear` holds them
    else:
        parts = quantize(w, spec).parts()
        qweight, scales, biases = parts["qweight"], parts["scales"], parts.get("biases")
    calls = []
    real = cpu_moe.cpu_quant_linear

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(cpu_moe, "cpu_quant_linear", counted)
    for T in (1, 5, cpu_moe.QLINEAR_MAX_TOKENS, cpu_moe.QLINEAR_MAX_TOKENS + 1):
        x = torch.randn(T, K, generator=g)
        got = kernels.quant_linear(x, qweight, scales, biases, spec, bias)
        want = quant_linear_reference(x, qweight, scales, biases, spec, bias)   # sums of ~K terms of ~1: the
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)           # summation order moves ~1e-5
        if T == 5:   # rows meet several inputs at once: each input's result has the bits it has alone
            assert all(torch.equal(got[t], kernels.quant_linear(x[t:t + 1], qweight, scales, biases, spec, bias)[0])
                       for t in range(T))
    assert calls == [1, 5, 1, 1, 1, 1, 1, cpu_moe.QLINEAR_MAX_TOKENS]
