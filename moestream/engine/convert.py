"""`moestream convert`: a Hugging Face checkpoint → the engine's packed checkpoint (checkpoint/packed.py).

It sits in the engine layer, beside the loader that reads what it writes (weights.py for the dense
file, `experts/store.py: PackedExpertStore` for the expert records), because deciding what to write
takes both the model's modules (which tensors a recipe quantizes) and the expert formats.

Layer by layer, with bounded memory: the dense tensors go to one safetensors file (quantized where
the recipe says), each MoE layer's experts to one file of 4 KiB-aligned records (one record per
expert, every tensor of it back to back, quantized by the expert format) with a CRC-32 each.

Everything is written into `.<out>.partial` beside the output and renamed to the output name only
when complete, so nothing half-written ever carries the final name. A run that stops (Ctrl-C, a
full disk, a crash) leaves the layers it finished in that folder with a progress file; the same
command resumes from there (a different source or recipe starts again). Output is deterministic:
converting twice gives byte-identical files. An FP8 checkpoint (`quant/fp8.py`) converts from the
weights its FP8 values stand for (the packed checkpoint its dequantized export would give), or,
without `--experts`, keeps its experts' FP8 bytes and scales as they are in the records.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from moestream.archs import ModelConfig, detect_arch, model_config_from_hf
from moestream.checkpoint import TensorIndex, read_config, resolve_checkpoint
from moestream.checkpoint.gguf_file import is_gguf
from moestream.checkpoint.packed import FORMAT, LAYOUT_NAME, VERSION, LayerRecords, PackedLayout, record_layout
from moestream.checkpoint.safetensors_writer import write_safetensors
from moestream.errors import InputError
from moestream.experts.format import stored_format
from moestream.experts.store import CheckpointExpertStore, Fp8ExpertStore
from moestream.fileio import write_atomic, write_json_atomic
from moestream.model.decoder import MoECausalLM, parameter_dtype
from moestream.model.quant_linear import QuantEmbedding, QuantLinear, quantize_modules
from moestream.quant import QuantizedTensor, quantize
from moestream.quant.fp8 import dequantize_fp8, fp8_quantization
from moestream.quant.gptq import int_quantization
from moestream.quant.mlx import mlx_quantization
from moestream.quant.mxfp4 import mxfp4_quantization
from moestream.quant.recipe import QuantRecipe

PROGRESS = "progress.json"
DENSE = "model.safetensors"
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
          "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


@dataclass
class ConvertResult:
    out: Path
    source_bytes: int      # bytes of the source tensors read
    written_bytes: int
    seconds: float
    resumed_layers: int    # MoE layers an interrupted run had finished, kept
    resumed_parts: int = 0  # the same, counting the dense file

    @property
    def gb_per_s(self) -> float:
        return self.source_bytes / 1e9 / self.seconds if self.seconds else 0.0


def _identity(folder: Path, index: TensorIndex, recipe: QuantRecipe, dtype: torch.dtype) -> dict:
    """What a resumed run must agree on: the source (config bytes, shard names and sizes) and the recipe."""
    shards = sorted({(info.path.name, info.path.stat().st_size) for info in index.tensors.values()})
    return {"config_sha256": hashlib.sha256((folder / "config.json").read_bytes()).hexdigest(),
            "shards": [list(s) for s in shards], "recipe": recipe.as_dict(),
            "dtype": str(dtype).removeprefix("torch.")}


def _dense_layout(model: MoECausalLM, config: ModelConfig, dtype: torch.dtype) -> list[tuple[str, tuple, torch.dtype, str]]:
    """(name written, shape, dtype, source module) of every dense tensor, in module order; a tied LM
    head is not written (the loader reads the embedding)."""
    out = []
    for path, module in model.named_modules():
        if path == "lm_head" and config.tie_embeddings:
            continue
        quant = isinstance(module, (QuantLinear, QuantEmbedding))
        for name, p in module.named_parameters(recurse=False):
            keep = quant and name in ("qweight", "scales", "biases")
            out.append((f"{path}.{name}", tuple(p.shape), p.dtype if keep else parameter_dtype(module, name, dtype), path))
    return out


def _disk_error(exc: OSError, where: Path) -> InputError:
    if exc.errno == errno.ENOSPC:
        return InputError(f"the disk filled up while writing {where}; free space and run the same command again "
                          "to resume.")
    return InputError(f"cannot write {where} ({exc.strerror or exc}); check the folder's permissions and space.")


class Converter:
    def __init__(self, source: str | Path, out: str | Path, recipe: QuantRecipe, dtype: str = "auto",
                 device: str = "auto", force: bool = False, progress: bool = True):
        self.folder = resolve_checkpoint(source)
        if is_gguf(self.folder):
            raise InputError(f"{self.folder} is a GGUF checkpoint; run it as it is (moestream reads GGUF files "
                             "directly) or convert its full-precision source.")
        raw = read_config(self.folder)
        if PackedLayout.present(self.folder):
            raise InputError(f"{self.folder} is already a packed checkpoint; convert its Hugging Face source instead.")
        int_quant = int_quantization(raw)
        if int_quant is not None:
            raise InputError(f"{self.folder} is a {int_quant.method}-quantized checkpoint; run it as it is (moestream "
                             "reads it directly) or convert its full-precision source.")
        if mlx_quantization(raw) is not None:
            raise InputError(f"{self.folder} is an MLX-quantized checkpoint; run it as it is (moestream reads MLX "
                             "checkpoints directly) or convert its full-precision source.")
        if mxfp4_quantization(raw):
            raise InputError(f"{self.folder} is an MXFP4-quantized checkpoint; run it as it is (moestream keeps its "
                             "experts in their MXFP4 bytes), a packed copy would not be smaller.")
        self.spec = detect_arch(raw)
        self.config = model_config_from_hf(raw, self.spec)
        self.recipe = recipe.validate(self.config.num_layers)
        self.fp8 = fp8_quantization(raw)
        if recipe.spec("experts") is None and self.fp8 is None:
            raise InputError("convert needs --experts FORMAT (e.g. int4): a packed checkpoint stores quantized experts "
                             "(an FP8 checkpoint's own FP8 experts without it).")
        self.out = Path(out).expanduser().resolve()
        if self.out == self.folder.resolve():
            raise InputError("the output folder is the source checkpoint; choose another output folder.")
        if self.out.exists() and not force:
            raise InputError(f"{self.out} already exists; pass --force to overwrite it or choose another folder.")
        if not self.out.parent.is_dir():
            raise InputError(f"the folder {self.out.parent} does not exist; create it or choose another output path.")
        self.work = self.out.parent / f".{self.out.name}.partial"
        self.index = TensorIndex(self.folder)
        self.store = (Fp8ExpertStore(self.index, self.config, self.spec, self.fp8) if self.fp8 is not None
                      else CheckpointExpertStore(self.index, self.config, self.spec))
        stored = raw.get("torch_dtype") or raw.get("dtype")
        self.dtype = ({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype] if dtype != "auto"
                      else getattr(torch, str(stored), torch.bfloat16) if stored else torch.bfloat16)
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if device == "auto" else device))
        self.progress = progress

    # ---- the run --------------------------------------------------------------------------
    def run(self) -> ConvertResult:
        t0 = time.perf_counter()
        identity = _identity(self.folder, self.index, self.recipe, self.dtype)
        done = self._resume(identity)
        kept = set(done)
        resumed = sum(1 for k in done if k != "dense")
        layers = self.store.moe_layers
        per_expert = self.store.dtype.itemsize * 3 * self.config.hidden_size * self.config.moe_intermediate
        source_bytes = per_expert * self.config.num_experts * len(layers)
        bar = self._bar(len(layers) * self.config.num_experts + 1,
                        (resumed * self.config.num_experts) + ("dense" in done))
        try:
            for name in COPIED:
                if (self.folder / name).is_file():
                    shutil.copyfile(self.folder / name, self.work / name)
            if self.fp8 is not None:   # the packed checkpoint's weights are not FP8
                raw = json.loads((self.folder / "config.json").read_text())
                raw.pop("quantization_config")
                write_json_atomic(self.work / "config.json", raw)
            if "dense" not in done:
                self._write_dense()
                done["dense"] = True
                self._save_progress(identity, done)
                bar.update(1)
            records = {}
            for layer in layers:
                key = str(layer)
                if key not in done:
                    done[key] = self._write_layer(layer, bar).as_dict()
                    self._save_progress(identity, done)
                records[layer] = done[key]
            self._write_layout(records)
        except OSError as exc:
            raise _disk_error(exc, self.work) from None
        finally:
            bar.close()
        self._install()
        written = sum(p.stat().st_size for p in self.out.rglob("*") if p.is_file())
        return ConvertResult(self.out, source_bytes, written, time.perf_counter() - t0, resumed,
                             resumed + ("dense" in kept))

    def _bar(self, total: int, initial: int):
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, unit="expert", desc="convert", disable=not self.progress,
                    dynamic_ncols=True)

    @property
    def parts(self) -> int:
        """What a run writes and a rerun can keep: the dense file and one file per MoE layer."""
        return 1 + len(self.store.moe_layers)

    def finished_parts(self) -> int:
        """Parts an interrupted run with the same source and recipe left finished: this run keeps them."""
        return len(self._saved(_identity(self.folder, self.index, self.recipe, self.dtype)))

    def _saved(self, identity: dict) -> dict:
        progress = self.work / PROGRESS
        if progress.is_file():
            try:
                saved = json.loads(progress.read_text())
                if saved.get("identity") == identity:
                    return dict(saved.get("done", {}))
            except (OSError, ValueError):
                pass
        return {}

    def _resume(self, identity: dict) -> dict:
        """What a previous run with the same identity finished; anything else is wiped."""
        done = self._saved(identity)
        if done:
            return done
        if self.work.exists():
            shutil.rmtree(self.work)
        try:
            (self.work / "experts").mkdir(parents=True)
        except OSError as exc:
            raise _disk_error(exc, self.work) from None
        return {}

    def _save_progress(self, identity: dict, done: dict) -> None:
        write_json_atomic(self.work / PROGRESS, {"identity": identity, "done": done})

    def _write_dense(self) -> None:
        with torch.device("meta"):
            model = MoECausalLM(self.config, self.spec)
        quantize_modules(model, lambda path: self.recipe.spec_for(path, self.config.num_layers))
        modules = dict(model.named_modules())
        layout = _dense_layout(model, self.config, self.dtype)
        source = {name: module for name, _, _, module in layout}
        cache: dict[str, QuantizedTensor] = {}

        def produce(name: str) -> torch.Tensor:
            module_path = source[name]
            part = name.rsplit(".", 1)[1]
            module = modules[module_path]
            if isinstance(module, (QuantLinear, QuantEmbedding)) and part in ("qweight", "scales", "biases"):
                if module_path not in cache:
                    cache.clear()   # one module's quantized parts in memory at a time
                    weight = self._read_float(f"{module_path}.weight").to(self.device)
                    cache[module_path] = quantize(weight, module.spec)
                return cache[module_path].parts()[part]
            return self._read_float(name).to(parameter_dtype(module, part, self.dtype))

        write_atomic(self.work / DENSE, lambda f: write_safetensors(
            f, [(n, s, d) for n, s, d, _ in layout], produce, {"format": "moestream-packed-dense"}))

    def _read_float(self, name: str) -> torch.Tensor:
        """A full-precision tensor of the source, dequantized where an FP8 source stores it in FP8."""
        if self.fp8 is not None and self.index.info(name).dtype == torch.float8_e4m3fn:
            scale = self.index.read(name.removesuffix("weight") + self.fp8.scale_name)
            return dequantize_fp8(self.index.read(name), scale, self.fp8)
        return self.index.read(name, floating=True)

    def _write_layer(self, layer: int, bar) -> LayerRecords:
        spec = self.recipe.spec("experts", layer, self.config.num_layers) or self.fp8   # None: FP8's own
        fmt = stored_format(spec, self.dtype)
        tensors, stride = record_layout([(t.name, t.shape, t.dtype) for t in fmt.tensors(self.store.shape)])
        name = f"experts/layer-{layer:03d}.bin"
        checksums = []

        def fill(f) -> None:
            buf = fmt.empty(self.store.shape)
            record = torch.zeros(stride, dtype=torch.uint8)
            for e in range(self.config.num_experts):
                if spec is self.fp8:   # the stored bytes and scales, as they are
                    self.store.read_into(layer, e, fmt, buf)
                else:
                    gate, up, down = (t.to(self.device) for t in self.store.read_raw(layer, e))
                    fmt.encode(gate, up, down, buf)
                crc = 0
                for entry in tensors:
                    data = buf[entry.name].view(-1).view(torch.uint8)
                    record[entry.offset:entry.offset + entry.nbytes] = data
                    crc = zlib.crc32(memoryview(data.numpy()), crc)
                checksums.append(crc)
                f.write(memoryview(record.numpy()))
                bar.update(1)

        write_atomic(self.work / name, fill)
        return LayerRecords(name, spec, stride, tensors, tuple(checksums))

    def _write_layout(self, records: dict[int, dict]) -> None:
        layers = {str(k): v for k, v in sorted(records.items())}
        data = {"format": FORMAT, "version": VERSION, "dtype": str(self.dtype).removeprefix("torch."),
                "recipe": self.recipe.as_dict(), "num_experts": self.config.num_experts, "layers": layers,
                "source": {"checkpoint": self.folder.name, "arch": self.spec.name}}
        text = json.dumps(data, indent=1, sort_keys=True).encode()
        write_atomic(self.work / LAYOUT_NAME, lambda f: f.write(text))
        (self.work / PROGRESS).unlink()

    def _install(self) -> None:
        """Rename the finished folder to the output name (an existing output, with --force, goes last)."""
        old = None
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}.old"
            if old.exists():
                shutil.rmtree(old)
            self.out.rename(old)
        self.work.rename(self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def convert(source: str | Path, out: str | Path, recipe: QuantRecipe, **kw) -> ConvertResult:
    """Convert `source` to a packed checkpoint at `out` (see Converter for the keywords)."""
    return Converter(source, out, recipe, **kw).run()


__all__ = ["ConvertResult", "Converter", "convert"]
