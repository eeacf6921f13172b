"""`moestream convert`: a Hugging Face checkpoint → a packed checkpoint (`engine/convert.py`)."""

from __future__ import annotations

import sys

from moestream.checkpoint.resolve import local_checkpoint, read_config
from moestream.cli.common import recipe
from moestream.cli.interrupts import interrupts
from moestream.cli.flags import add_quant_args
from moestream.errors import InputError


def add_parser(sub) -> None:
    conv = sub.add_parser("convert", help="write a packed checkpoint with quantized experts (and dense tensors)")
    conv.add_argument("source", help="Hugging Face checkpoint folder or hub id (bf16/fp16/fp32, or FP8)")
    conv.add_argument("out", help="output folder (written beside as .OUT.partial, renamed when complete)")
    add_quant_args(conv, "required, except that an FP8 checkpoint without it keeps its FP8 experts")
    conv.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                      help="dtype of the tensors kept at full precision (default: the source's)")
    conv.add_argument("--device", default="auto", help="where to quantize: cpu, cuda or auto")
    conv.add_argument("--force", action="store_true", help="overwrite an existing output folder")
    conv.set_defaults(func=run)


def may_skip_experts(raw: dict) -> bool:
    """Whether config.json may name an FP8 checkpoint, whose own FP8 experts convert without
    --experts (compressed-tensors may be FP8 or integer: the Converter tells them apart), or an
    MXFP4 one, which the Converter refuses by name (asking for --experts would mislead)."""
    q = raw.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") in ("fp8", "compressed-tensors", "mxfp4")


def run(args) -> int:
    folder = local_checkpoint(args.source)
    if args.experts is None and folder is not None and not may_skip_experts(read_config(folder)):
        raise InputError("convert needs --experts FORMAT (e.g. int4): a packed checkpoint stores quantized experts "
                         "(an FP8 checkpoint's own FP8 experts without it).")
    from moestream.engine.convert import Converter
    from moestream.sizes import format_bytes, format_rate

    converter = Converter(args.source, args.out, recipe(args), dtype=args.dtype, device=args.device, force=args.force,
                          progress=sys.stderr.isatty())
    kept = converter.finished_parts()
    if kept:
        print(f"[moestream] resuming an interrupted conversion: {kept} of {converter.parts} parts (the dense "
              f"tensors, one per MoE layer) are already written in {converter.work}", file=sys.stderr)
    interrupts.note = f"run the same command again to resume ({converter.work} keeps the finished layers)"
    result = converter.run()
    interrupts.note = None
    resumed = (f"; resumed, keeping {result.resumed_parts} of {converter.parts} parts from the interrupted run"
               if result.resumed_parts else "")
    print(f"[moestream] wrote {result.out} ({format_bytes(result.written_bytes)}) in {result.seconds:.1f} s, "
          f"{format_rate(result.source_bytes, result.seconds)} of expert weights{resumed}", file=sys.stderr)
    return 0
