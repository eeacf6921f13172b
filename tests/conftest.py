import pytest

from tiny_models import ARCHS, make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """arch → (folder, transformers model) for every supported family, built once per session."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, make_tiny_checkpoint(arch, root / arch)) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_checkpoints):
    return tiny_checkpoints["qwen3_moe"][0]
