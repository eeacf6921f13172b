import pytest

from tiny_models import ARCHS, QUANT_ARCHS, make_quant_tiny_checkpoint, make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """arch → (folder, transformers model) for every supported family, built once per session."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, make_tiny_checkpoint(arch, root / arch)) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_checkpoints):
    return tiny_checkpoints["qwen3_moe"][0]


@pytest.fixture(scope="session")
def tiny_quant_checkpoints(tmp_path_factory):
    """arch → (folder, transformers model): tiny checkpoints whose widths fit quantization groups of 32 and 64
    (the families whose experts can be quantized)."""
    root = tmp_path_factory.mktemp("tiny_quant")
    return {arch: (root / arch, make_quant_tiny_checkpoint(root / arch, arch=arch)) for arch in QUANT_ARCHS}


@pytest.fixture(scope="session")
def tiny_quant(tiny_quant_checkpoints):
    return tiny_quant_checkpoints["qwen3_moe"][0]
