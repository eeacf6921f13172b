import pytest

from tiny_models import ARCHS, make_quant_tiny_checkpoint, make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """arch → (folder, transformers model) for every supported family, built once per session."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, make_tiny_checkpoint(arch, root / arch)) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_checkpoints):
    return tiny_checkpoints["qwen3_moe"][0]


@pytest.fixture(scope="session")
def tiny_quant(tmp_path_factory):
    """A tiny qwen3_moe checkpoint whose widths fit every quantization group size of 32 and 64."""
    folder = tmp_path_factory.mktemp("tiny_quant") / "qwen3_moe"
    make_quant_tiny_checkpoint(folder)
    return folder
