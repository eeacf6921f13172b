"""scripts/make_random_checkpoint.py --gptq: the GPTQ form of a random checkpoint, read by moestream
with the same logits as transformers on the weights the reference dequantization gives."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import moestream
from moestream.quant.gptq import dequantize_int, int_quantization, unpack_gptq

ROOT = Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("make_random_checkpoint", ROOT / "scripts" / "make_random_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


mrc = _load_script()


@pytest.mark.parametrize("bits,group", [(4, 32)])
def test_gptq_form_loads_and_matches_its_dequantization(tmp_path, bits, group):
    out = tmp_path / "gptq"
    mrc.main(["--shape", "qwen3-30b-a3b", "--tiny", "--dtype", "fp32", "--out", str(out), "--gptq", str(bits),
              "--gptq-group", str(group), "--workers", "1"])
    raw = json.loads((out / "config.json").read_text())
    quant = int_quantization(raw)
    assert quant.method == "gptq" and quant.bits == bits and quant.group == group and quant.sym
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    assert "model.layers.0.mlp.experts.0.gate_proj.qweight" in tensors
    assert "model.layers.0.mlp.gate.weight" in tensors   # the router stays at full precision
    assert tensors["model.layers.0.self_attn.q_proj.scales"].dtype == torch.float16
    # the oracle: every GPTQ module dequantized by the reference, in a plain HF checkpoint
    deq = {}
    for name, t in tensors.items():
        base, _, part = name.rpartition(".")
        if part == "qweight":
            n, k = t.shape[1], t.shape[0] * 32 // bits
            iw = unpack_gptq(quant, n, k, t, tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], tensors[f"{base}.g_idx"])
            deq[f"{base}.weight"] = dequantize_int(iw)
            assert 0.005 < deq[f"{base}.weight"].std() < 0.05   # spread like the other random weights
        elif part not in ("qzeros", "scales", "g_idx"):
            deq[name] = t
    ref = tmp_path / "ref"
    ref.mkdir()
    save_file(deq, str(ref / "model.safetensors"))
    (ref / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "quantization_config"}))
    reference = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    engine = moestream.load(out, device="cpu", dtype="float32")
    assert engine.bank.formats[0].name == ("int4-g32" if bits == 4 else "int8-g128")
    ids = torch.randint(2, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(ids).logits
    got = engine.logits(ids, torch.ones_like(ids))
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4


def test_gptq_and_fp8_forms_exclude_each_other(tmp_path):
    """A checkpoint has one quantization_config: --gptq with --fp8-block is refused, and so is a GPTQ
    width the form does not have, dry run or not."""
    with pytest.raises(SystemExit, match="give one of them"):
        mrc.main(["--shape", "qwen3-30b-a3b", "--tiny", "--out", str(tmp_path / "x"), "--gptq", "4",
                  "--fp8-block", "16x16", "--dry-run"])
    with pytest.raises(SystemExit, match="--gptq takes 2/3/4/8 bits"):
        mrc.main(["--shape", "qwen3-30b-a3b", "--tiny", "--out", str(tmp_path / "x"), "--gptq", "5", "--dry-run"])
    assert not (tmp_path / "x").exists()
