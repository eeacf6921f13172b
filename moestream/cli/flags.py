"""The flags several commands share, in one place, and the argparse types that check numbers as
they are parsed (an out-of-range value is one `moestream: error:` line before anything loads)."""

from __future__ import annotations

import argparse
import sys

class Parser(argparse.ArgumentParser):
    """argparse with our one-line errors (`moestream: error: --flag ...; see ... --help`) and exit 1,
    like every other bad input."""

    def error(self, message: str):
        message = message.replace("argument ", "", 1) if message.startswith("argument ") else message
        print(f"moestream: error: {message}; see `{self.prog} --help`.", file=sys.stderr)
        sys.exit(1)


def add_json_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """`--json [FILE]`, the same in every command: FILE gets the JSON; without one (or with -) the JSON is
    printed alone on stdout, in place of the text report."""
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help=f"{what} as JSON: written to FILE, or printed alone on stdout without one (or with -)")


def integer(low: int | None = None, high: int | None = None):
    """An argparse type: an integer in [low, high] (either bound optional)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_range(low, high)}, got {value}")
        return value
    return parse


def number(low: float | None = None, high: float | None = None, low_open: bool = False, high_open: bool = False):
    """An argparse type: a finite number in the given (half-)open or closed range."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        bad = (value != value or value in (float("inf"), float("-inf"))
               or (low is not None and (value < low or (low_open and value == low)))
               or (high is not None and (value > high or (high_open and value == high))))
        if bad:
            raise argparse.ArgumentTypeError(f"must be {_range(low, high, low_open, high_open)}, got {text}")
        return value
    return parse


def share_or_auto(text: str) -> float | str:
    """--cpu-misses: `auto` or a share from 0 to 1."""
    return "auto" if text == "auto" else number(0, 1)(text)


def _range(low, high, low_open: bool = False, high_open: bool = False) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def chunk_tokens(text: str) -> int | str:
    """--prefill-chunk: a number of tokens (at least 1) or `auto`."""
    return "auto" if text == "auto" else integer(1)(text)


def add_prefill_chunk_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-chunk", type=chunk_tokens, default="auto", metavar="TOKENS|auto",
                   help="prompt tokens per forward (default auto): the memory plan holds their activations; with a "
                        "bounded bank each forward streams the experts it lacks once, and quantized experts take the "
                        "dequantized path from 1,024 tokens (4-bit) or 3,072 (8-bit), so long prompts run faster in "
                        "larger chunks where memory allows; auto: with a bounded bank the longest of 4096, 2048 "
                        "and 1024 tokens that costs the bank at most a tenth of its slots, else (and fully "
                        "resident) 512 (`check` shows the choice)")


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="checkpoint folder or hub id (default: the bundled demo model)")
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default: auto)")
    add_devices_args(p)
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--max-context", type=integer(2), default=None, help="KV cache length (default: the model's maximum)")
    add_prefill_chunk_arg(p)
    p.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                   help="launch each decode step before the host reads the last one's tokens, so the host's work "
                        "between steps runs while the device computes: auto (default) where a decode step reads "
                        "nothing back on a GPU (whole-step CUDA graphs); on; off")
    p.add_argument("--pack-prompts", default="on", choices=["on", "off"],
                   help="on (default): the prompts admitted in one step run as one forward, each layer's experts "
                        "once for all of them (a bounded bank copies a missing expert once a step, not once a "
                        "prompt), the next prompt cut to fill the step's --prefill-chunk, and at a bounded bank "
                        "the decoding streams' tokens in that forward too; off: one forward per "
                        "prompt, each whole where it fits a chunk (for comparison)")
    add_kv_args(p)
    add_budget_args(p)
    p.add_argument("--host-memory", default=None, help="pinned host RAM for experts off the device, e.g. 64GiB (default: 60%% of available RAM; beyond it experts are read from disk)")
    p.add_argument("--host-tier", default="auto", choices=["auto", "pinned", "disk"], help="where missing experts come from")
    p.add_argument("--miss-policy", default="auto", choices=["auto", "fetch", "hybrid", "skip"],
                   help="hybrid = missing experts computed from host RAM without a read-back: on a GPU, the GPU "
                        "reads some in place while a CPU thread computes the others, decode steps as whole CUDA "
                        "graphs; on the CPU, the CPU thread computes them all (exact; needs the host tier in RAM; "
                        "bf16/fp32, 8/4/2-bit or NF4 experts); fetch = copy missing experts into the bank (exact); "
                        "skip = drop non-resident experts and renormalise (approximate); auto (default) = hybrid "
                        "with a bounded bank on one GPU, else fetch (with --devices, hybrid has each rank's CPU "
                        "compute its own experts' misses on its share of the cores)")
    p.add_argument("--residency", default="lcp", choices=["lcp", "lru"], help="which experts stay in the bank")
    p.add_argument("--cpu-misses", type=share_or_auto, default=None, metavar="SHARE|auto",
                   help="fetch: a decode step's missing experts computed on the CPU from host RAM while the rest are "
                        "copied: a share of them (1: all), or auto (split by costs measured at the first decode step) "
                        "(exact; needs the pinned host tier; off by default); hybrid: the CPU's share of a "
                        "one-stream step's missing experts, the GPU reading the rest (default auto: from 0.6, moved "
                        "while decoding until both sides finish together)")
    p.add_argument("--prompt-cpu-misses", type=share_or_auto, default=0.0, metavar="SHARE|auto",
                   help="a prompt chunk's missing experts computed on the CPU from host RAM while the rest stream in "
                        "over PCIe: a share of them (those fewest of its tokens routed to first), or auto (split by "
                        "the costs measured at the first call) (exact; needs the pinned host tier; off by default)")
    p.add_argument("--cpu-threads", type=integer(1), default=None, metavar="N",
                   help="threads of the CPU's work: torch's intra-op threads (the whole model on --device cpu) and "
                        "the kernel computing missed experts (--cpu-misses, --miss-policy hybrid) (default: every "
                        "core this process may use but one, the kernel's at most 16; OMP_NUM_THREADS, where set, sizes torch's "
                        "instead)")
    p.add_argument("--prefetch", action="store_true",
                   help="predict the next layer's experts and copy them ahead (fetch policy; measured slower at "
                        "the demo model's 65%% prediction accuracy, see BENCHMARKS.md)")
    p.add_argument("--no-discovery", dest="discovery", action="store_false",
                   help="fill a bounded bank without the router-only pass over a warm-up prompt")
    p.add_argument("--prepack", default=None, metavar="DIR",
                   help="load the warmed bank from this folder when it matches; otherwise build, warm and save it there")
    p.add_argument("--warmup-tokens", type=integer(0), default=None,
                   help="generate this many tokens before the first request (default: 8 with --prepack, else 0)")
    p.add_argument("--mla-absorbed", action="store_true",
                   help="multi-head latent attention models (DeepSeek-V2/V3, GLM-4.7-Flash): attend over the latent "
                        "cache with the key/value up-projections absorbed into the query and output, instead of "
                        "expanding every cached position per head")
    p.add_argument("--verbose", action="store_true", help="print the memory plan, discovery and prepack details to stderr")
    add_quant_args(p)


def add_devices_args(p: argparse.ArgumentParser, what: str = "") -> None:
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="expert parallel: one rank per device, each holding a share of the experts: cuda:0,cuda:1 | "
                        "all | a GPU count | cpu,cpu (budgets are per device)" + what)
    p.add_argument("--dist-backend", default="auto", choices=["auto", "nccl", "gloo"],
                   help="the ranks' collectives (default: NCCL on CUDA, gloo on CPU); gloo lets two ranks share "
                        "one GPU, for testing and debugging")


def add_quant_args(p: argparse.ArgumentParser, what: str = "quantize on load") -> None:
    """Precision per tensor class (routers always stay at full precision)."""
    names = "int8, int4, int3, int2, nf4, nf3 (optionally -g32/-g64/-g128), or bf16/fp16/fp32 for none"
    p.add_argument("--experts", default=None, metavar="FORMAT", help=f"routed experts ({what}): {names}")
    p.add_argument("--shared", default=None, metavar="FORMAT", help="shared experts and dense FFN layers")
    p.add_argument("--attention", default=None, metavar="FORMAT", help="attention projections")
    p.add_argument("--embeddings", default=None, metavar="FORMAT", help="token embeddings and the LM head")
    p.add_argument("--layer-format", action="append", default=[], metavar="LAYER=FORMAT",
                   help="override every quantized class of one layer, e.g. 0=int8 -1=int8 (repeatable)")


def add_budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-memory", default=None, help="everything the engine may take on the device, e.g. 16GiB (default: free memory less headroom)")
    p.add_argument("--memory", default=None, help="alias of --gpu-memory that names no device (the RAM bank on CPU)")
    p.add_argument("--capacity", type=integer(1), default=None, help="bank slots per layer (overrides the budget's choice)")


def add_kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-layout", default="auto", choices=["auto", "paged", "rows"],
                   help="paged: keys and values in blocks shared by every sequence and the prefix cache; rows: one "
                        "full-context row per sequence; auto (default): paged where every layer keeps full keys and "
                        "values")
    p.add_argument("--kv-block-size", type=integer(1, 1024), default=16, metavar="N",
                   help="positions per block of a paged cache (default 16)")
    p.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help="device memory of a paged cache, e.g. 4GiB (default: --max-batch full contexts plus "
                        "--prefix-cache-memory)")


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None, help="expert profile JSON from `moestream profile`: seeds the bank with its most used experts")
    pin = p.add_mutually_exclusive_group()
    pin.add_argument("--pin-top-k", type=integer(0), default=None, help="with --profile: pin the K most used experts of every layer")
    pin.add_argument("--pin-threshold", type=number(0, 1), default=None,
                     help="with --profile: pin the experts active on more than this fraction of tokens")

