"""scripts/make_random_checkpoint.py --mxfp4: gpt-oss's experts written as the Hub ships them, read by
moestream in their bytes with the logits transformers gives loading the same files dequantized."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

import moestream

ROOT = Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("make_random_checkpoint", ROOT / "scripts" / "make_random_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


mrc = _load_script()


def test_mxfp4_form_loads_with_transformers_logits(tmp_path):
    out = tmp_path / "mxfp4"
    mrc.main(["--shape", "gpt-oss-20b", "--tiny", "--dtype", "fp32", "--out", str(out), "--mxfp4", "--workers", "1"])
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    engine = moestream.load(out, device="cpu", dtype="float32")
    assert engine.bank.slots[0].tensors["gate_up.blocks"].dtype == torch.uint8
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    ids = torch.randint(2, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
    assert (engine.logits(ids) - want).abs().max() / want.abs().max() <= 1e-4


def test_mxfp4_is_for_gpt_oss_shapes_only(tmp_path):
    with pytest.raises(SystemExit, match="gpt-oss"):
        mrc.main(["--shape", "qwen3-30b-a3b", "--tiny", "--out", str(tmp_path / "x"), "--mxfp4"])
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("other", [["--gptq", "4"], ["--fp8-block", "16x16"]])
def test_mxfp4_excludes_the_other_quantized_forms(tmp_path, other):
    """A checkpoint has one quantization_config: --mxfp4 with --gptq or --fp8-block is refused, dry run included."""
    with pytest.raises(SystemExit, match=f"{other[0]} and --mxfp4 each write the whole checkpoint's quantization; "
                                         "give one of them"):
        mrc.main(["--shape", "gpt-oss-20b", "--tiny", "--out", str(tmp_path / "x"), "--mxfp4", *other, "--dry-run"])
    assert not (tmp_path / "x").exists()
