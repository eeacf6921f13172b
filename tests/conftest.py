import re

import pytest

from tiny_models import ARCHS, QUANT_ARCHS, make_quant_tiny_checkpoint, make_tiny_checkpoint


GPU_REASON = re.compile(r"^(?!.*\bno GPU).*needs .*\b(CUDA|GPUs?)\b")   # "needs a CUDA GPU", not "... and no GPU"


def pytest_addoption(parser):
    parser.addoption("--gpu-only", action="store_true",
                     help="run only the tests that need a GPU (those skipped without one): the GPU machine's check")


def pytest_collection_modifyitems(config, items):
    """--gpu-only keeps the tests whose skip condition names a GPU; the rest run in CI anyway."""
    if not config.getoption("--gpu-only"):
        return
    needs_gpu = [item for item in items
                 if any(GPU_REASON.search(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif"))]
    config.hook.pytest_deselected(items=[item for item in items if item not in needs_gpu])
    items[:] = needs_gpu


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
