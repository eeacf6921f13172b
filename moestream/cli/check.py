"""`moestream check`: the memory plan for a checkpoint and a budget, from config.json alone."""

from __future__ import annotations

from moestream.cli.common import engine_config
from moestream.cli.flags import (add_budget_args, add_devices_args, add_kv_args, add_prefill_chunk_arg,
                                 add_quant_args, integer)


def add_parser(sub) -> None:
    check = sub.add_parser("check", help="show the memory plan for a budget without loading weights")
    check.add_argument("model", nargs="?", help="checkpoint folder or hub id (default: the bundled demo model)")
    check.add_argument("--device", default="auto",
                       help="the device the plan is for: cpu | cuda | cuda:N | auto (default: auto; a CPU plan counts "
                            "RAM and no CUDA workspace)")
    add_devices_args(check, "; one plan per rank")
    check.add_argument("--dtype", default="auto",
                       help="auto | float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    check.add_argument("--max-context", type=integer(2), default=None, help="KV cache length (default: the model's maximum)")
    add_prefill_chunk_arg(check)
    add_kv_args(check)
    add_budget_args(check)
    add_quant_args(check)
    check.add_argument("--measure-costs", action="store_true",
                       help="also time what a miss costs on this machine (copy over PCIe, an expert on the CPU) on "
                            "random experts of the model's shape: the inputs of --cpu-misses auto's split")
    check.set_defaults(func=run)


def run(args) -> int:
    """The memory plan for a checkpoint and budget, from config.json alone (no weights read)."""
    from moestream.engine.plan import plan_load

    cfg = engine_config(args)
    if cfg.runtime.devices:   # one plan per rank: each holds its share of the experts, sized by its budget
        from moestream.engine.ranks import explain_ranks, plan_ranks

        plans = plan_ranks(cfg)
        print_model(plans[0].plan)
        print()
        print(explain_ranks(plans))
        return 0
    plan = plan_load(cfg)
    print_model(plan)
    print(plan.memory.explain())
    print_cpu_path()
    if args.measure_costs:
        print_miss_costs(plan)
    return 0


def print_cpu_path() -> None:
    """What `--cpu-misses` would compute with on this host: the inputs its split starts from."""
    from moestream.kernels import cpu_moe

    cpus = len(cpu_moe.usable_cpus())
    if cpu_moe.load() is None:
        print(f"CPU experts       plain torch ({cpu_moe.unavailable_reason()}); --cpu-misses would be slow here")
    else:
        print(f"CPU experts       C kernel, {cpu_moe.default_threads(cpus)} of {cpus} cores by default (--cpu-threads); "
              f"--cpu-misses auto measures copy and CPU costs at the first decode step (--stats prints them; "
              f"--measure-costs here times them now)")


def print_miss_costs(plan) -> None:
    """The hybrid split's inputs (`MissCosts`), measured now on random experts of this model's shape
    and format in host RAM (pinned where a GPU can copy them): what `--cpu-misses auto` measures at
    its first decode step, here before any weight is read."""
    import torch

    from moestream.experts.fetch import MissCosts
    from moestream.experts.format import ExpertShape
    from moestream.kernels import cpu_moe

    fmt = next(iter(plan.expert_formats.values()), None)
    if fmt is None:
        print("miss costs        none: the model has no routed experts")
        return
    shape = ExpertShape.of(plan.config)
    nbytes = fmt.nbytes(shape)
    pin = plan.device.type == "cuda"
    # Up to 1 GiB of experts, more than a server's last-level cache, so every timed read is DRAM's.
    count = max(8, min(128, (1 << 30) // max(nbytes, 1)))
    g = torch.Generator().manual_seed(0)
    stack = {}
    for t in fmt.tensors(shape):
        if t.dtype.is_floating_point:
            data = (torch.randn((count, *t.shape), generator=g) * 0.02).to(t.dtype)
        else:
            data = torch.randint(0, 256, (count, *t.shape), generator=g, dtype=torch.uint8).view(t.dtype)
        stack[t.name] = data.pin_memory() if pin else data
    costs = MissCosts.measure(stack, fmt.host_dispatch(shape), plan.device, shape.hidden, fmt.dtype)
    threads = cpu_moe.default_threads(len(cpu_moe.usable_cpus()))
    print(f"miss costs        one {fmt.name} expert ({nbytes / 1e6:.2f} MB), measured now on {count} random experts:")
    if pin:
        print(f"  copy over PCIe  {costs.copy_s * 1e6:.0f} us ({nbytes / costs.copy_s / 1e9:.1f} GB/s)")
    print(f"  on the CPU      {costs.cpu_expert_s * 1e6:.0f} us for its first token ({nbytes / costs.cpu_expert_s / 1e9:.1f} "
          f"GB/s of weights, {threads} threads), +{costs.cpu_token_s * 1e6:.1f} us per further token")
    print(f"  CPU call        {costs.cpu_call_s * 1e6:.0f} us fixed (hidden rows to the host, the result back)")
    if pin:
        print(f"  both at once    {costs.contention:.2f}x the slower alone (both read host RAM)")


def print_model(plan) -> None:
    config = plan.config
    print(f"model             {plan.folder} ({plan.spec.name}, {config.num_layers} layers, {config.num_experts} experts, top-{config.top_k})")
    print(f"device            {plan.device} ({str(plan.dtype).replace('torch.', '')}), context {plan.context}")
    if getattr(plan, "int_quant", None) is not None:
        print_int_quant(plan)
    if plan.kind == "fp8":
        print_fp8(plan)
    if plan.kind == "mxfp4":
        print("experts           MXFP4, kept as stored (fp4 codes and an e8m0 scale per 32 values: 4.25 bits "
              "a weight, plus their biases); every other tensor as stored")
    if getattr(plan, "gguf", None) is not None:
        print_gguf(plan)


def print_fp8(plan) -> None:
    """An FP8 checkpoint: its experts kept in their FP8 bytes, or (--experts / --layer-formats) held in
    the format asked for, quantized at load from the dequantized weights."""
    from moestream.experts.format import Fp8Format

    asked = sorted({fmt.name for fmt in plan.expert_formats.values() if not isinstance(fmt, Fp8Format)})
    if not asked:
        print(f"experts           {plan.fp8.name}, kept as stored (a byte a weight + float32 block scales), "
              "and so are the dense FP8 linears")
        return
    kept = len(asked) < len({fmt.name for fmt in plan.expert_formats.values()})
    print(f"experts           {plan.fp8.name} in the checkpoint, held as {', '.join(asked)} (quantized at load from "
          f"the dequantized weights{'; the other layers kept as stored' if kept else ''})")


def print_gguf(plan) -> None:
    """A GGUF: the ggml types of its experts, per distinct mix, and what each is held as."""
    from moestream.experts.gguf_store import layer_types

    from moestream.quant import ggml

    held: dict[str, set[int]] = {}
    for layer, fmt in plan.expert_formats.items():
        types = layer_types(plan.gguf, layer)
        how = ("requantized" if any(t in ggml.REQUANTIZED for t in types) and getattr(fmt, "spec", None) is not None
               else "exact")
        held.setdefault(f"{'/'.join(types)} -> {fmt.name}, {how}", set()).add(layer)
    for what, layers in held.items():
        print(f"experts           {what} (gate/up/down; {len(layers)} layer{'s' if len(layers) > 1 else ''})")
    print_gguf_rebuilt(plan)


def print_gguf_rebuilt(plan) -> None:
    """Linears put back together from the rows of several GGUF tensors (Qwen3-Next's in_proj_qkvz
    from attn_qkv + attn_gate, fused q/k/v): their parts' types and what they are held as (their
    blocks where every part is of an exact type, at the widest one's bits; else the compute dtype)."""
    from moestream.checkpoint.gguf_index import GGUFIndex
    from moestream.quant import ggml

    index = GGUFIndex(plan.gguf, plan.spec, plan.config)
    rebuilt: dict[str, int] = {}
    for name, source in index.row_sources.items():
        spec = index.stored_spec(name.removesuffix(".weight"))
        parts = " + ".join(part.split(".")[2] for part in source.parts)
        types = [plan.gguf.tensors[part].type_name for part in source.parts]
        held = spec.name if spec is not None else str(plan.dtype).removeprefix("torch.") + \
            (", dequantized" if any(t not in ggml.FLOAT_TYPES for t in types) else "")
        what = f"{name.split('.')[-2]} from {parts} ({'/'.join(types)} -> {held})"
        rebuilt[what] = rebuilt.get(what, 0) + 1
    for what, layers in rebuilt.items():
        print(f"rebuilt           {what} ({layers} layer{'s' if layers > 1 else ''})")


def print_int_quant(plan) -> None:
    """A GPTQ / AWQ / compressed-tensors checkpoint: what it stores and what the experts are held as."""
    from moestream.quant.gptq import affine_spec

    held = next(iter(plan.expert_formats.values()), None)
    spec = getattr(held, "spec", None)
    scales = f" ({str(spec.scale_dtype).removeprefix('torch.')} scales and biases)" if spec is not None else ""
    how = "repacked exactly as" if affine_spec(plan.int_quant) is not None else "without an exact form, as"
    print(f"weights           {plan.int_quant.name}; experts {how} {held.name if held else '-'}{scales}")

