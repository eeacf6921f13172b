"""MLX-quantized checkpoints (mlx-community layout) read as they are: same logits and tokens as
transformers on the dequantized weights, experts through the bank at any capacity."""

import pytest
import torch
import transformers

import moestream
from moestream.archs import ARCHS as SPECS
from moestream.errors import InputError
from tiny_models import QUANT_ARCHS, make_mlx_checkpoint

IDS = torch.randint(2, 160, (2, 21), generator=torch.Generator().manual_seed(9))
MASK = torch.ones_like(IDS)
MASK[1, :6] = 0   # a padded row


@pytest.fixture(scope="module")
def mlx_checkpoints(tiny_quant_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx")
    out = {}
    for arch in QUANT_ARCHS:
        folder, ref = root / arch, root / f"{arch}-ref"
        make_mlx_checkpoint(tiny_quant_checkpoints[arch][0], folder, ref, SPECS[arch].moe_prefix)
        out[arch] = (folder, transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval())
    return out


@pytest.mark.parametrize("arch", QUANT_ARCHS)
def test_mlx_checkpoint_matches_transformers_on_dequantized_weights(mlx_checkpoints, arch):
    folder, reference = mlx_checkpoints[arch]
    engine = moestream.load(folder, device="cpu", dtype="float32")
    first_moe_layer = engine.config.moe_layers.index(True)   # GLM's layer 0 is dense
    assert engine.plan.kind == "mlx" and engine.bank.formats[first_moe_layer].name == "int4-g32"
    with torch.no_grad():
        ref = reference(IDS, attention_mask=MASK).logits
    out = engine.logits(IDS, MASK)
    valid = MASK.bool()
    assert (out - ref)[valid].abs().max() / ref[valid].abs().max() <= 1e-4
    prompt = IDS[0, :9].tolist()
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 9, dtype=torch.long),
                                  max_new_tokens=16, do_sample=False)[0, 9:].tolist()
    got = engine.generate(prompt, max_tokens=16, ignore_eos=True)
    assert got == want[:len(got)]
    bounded = moestream.load(folder, device="cpu", dtype="float32", capacity=3)
    assert bounded.generate(prompt, max_tokens=16, ignore_eos=True) == got


def test_mlx_checkpoint_refuses_requantizing(mlx_checkpoints):
    with pytest.raises(InputError, match="precision is fixed"):
        moestream.load(mlx_checkpoints["qwen3_moe"][0], device="cpu", dtype="float32", experts="int8")
