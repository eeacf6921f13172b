"""`moestream convert`: a Hugging Face checkpoint → a packed checkpoint (`engine/convert.py`)."""

from __future__ import annotations

import sys

from moestream.cli.common import recipe
from moestream.cli.flags import add_quant_args
from moestream.errors import InputError


def add_parser(sub) -> None:
    conv = sub.add_parser("convert", help="write a packed checkpoint with quantized experts (and dense tensors)")
    conv.add_argument("source", help="Hugging Face checkpoint folder or hub id (bf16/fp16/fp32)")
    conv.add_argument("out", help="output folder (written beside as .OUT.partial, renamed when complete)")
    add_quant_args(conv, "required")
    conv.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                      help="dtype of the tensors kept at full precision (default: the source's)")
    conv.add_argument("--device", default="auto", help="where to quantize: cpu, cuda or auto")
    conv.add_argument("--force", action="store_true", help="overwrite an existing output folder")
    conv.set_defaults(func=run)


def run(args) -> int:
    from moestream.engine.convert import convert
    from moestream.sizes import format_bytes

    if args.experts is None:
        raise InputError("convert needs --experts FORMAT (e.g. int4): a packed checkpoint stores quantized experts.")
    result = convert(args.source, args.out, recipe(args), dtype=args.dtype, device=args.device, force=args.force,
                     progress=sys.stderr.isatty())
    resumed = f", resumed after {result.resumed_layers} finished layers" if result.resumed_layers else ""
    print(f"[moestream] wrote {result.out} ({format_bytes(result.written_bytes)}) in {result.seconds:.1f} s, "
          f"{result.gb_per_s:.2f} GB/s of expert weights{resumed}", file=sys.stderr)
    return 0

