import importlib
import importlib.util
import os
import re
import sys

import pytest

# torch and transformers are imported where a test process needs them (a worker, the fixtures), not
# here: pytest-xdist's controller loads this file before it starts the workers, and would hold them
# back for those imports (~4 s) though it runs no test.


def _hide_fla_from_transformers() -> None:
    """transformers is the tests' fp32 oracle, run on the CPU; with flash-linear-attention installed it
    calls fla's Triton kernels on CPU tensors ("cannot be accessed from Triton (cpu tensor?)" with a GPU,
    "0 active drivers" without one). moestream's own GPU path imports the gated delta rule's module now,
    and `fla` is then hidden (a None entry in sys.modules: find_spec says absent, import fails), so
    transformers takes its plain-torch Gated DeltaNet while moestream keeps the imported kernels."""
    if importlib.util.find_spec("fla") is None:
        return
    import torch

    if torch.cuda.is_available():
        try:
            importlib.import_module("fla.ops.gated_delta_rule")
        except Exception:   # a broken install: moestream treats it as absent too
            pass
    sys.modules["fla"] = None


_hide_fla_from_transformers()


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Worker processes share the cores: no more torch threads than their share, in the worker and in
    # every process it starts (expert-parallel followers, the CLI, benchmark scripts), whose torch
    # would otherwise take a thread per core. A follower rank that spins its threads while rank 0
    # waits on their all-reduce turns every all-reduce on a busy machine into tens of milliseconds.
    import torch

    _THREAD_SHARE = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(_THREAD_SHARE)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREAD_SHARE))


GPU_REASON = re.compile(r"^(?!.*\bno GPU).*needs .*\b(CUDA|GPUs?)\b")   # "needs a CUDA GPU", not "... and no GPU"


def pytest_addoption(parser):
    parser.addoption("--gpu-only", action="store_true",
                     help="run only the tests that need a GPU (those skipped without one): the GPU machine's check")


# The long tests `-m "not slow"` leaves out: kernels under Triton's interpreter and compiled for the
# H100, end-to-end servers and benchmark scripts, expert-parallel groups of processes, pytest run
# inside pytest, and whole-model checks of every family.
SLOW_FILES = ("tests/serve/", "tests/runtime/test_distributed.py", "tests/test_cli.py", "tests/test_convert.py",
              "tests/quant/test_int_checkpoints.py", "tests/warmstart/", "tests/scripts/",
              "tests/kernels/test_kernels_compile.py", "tests/test_gpu_only_option.py")
SLOW_NAMES = re.compile(r"interpreter|perplexity_matches_the_model_card")


# --gpu-only's worker processes on the one GPU (kernel compiles dominate; they run side by side);
# the environment may set another count (the check of this option starts two, each a torch import).
GPU_WORKERS = int(os.environ.get("MOESTREAM_TEST_GPU_WORKERS", "4"))


def pytest_cmdline_main(config):
    """--gpu-only runs in GPU_WORKERS processes where pytest-xdist is installed (the gpu extra brings it)
    and no -n was given: the GPU suite is mostly Triton compiles, which a single process runs one by one."""
    if hasattr(config, "workerinput"):
        return   # a worker runs the tests it is sent; only the controller starts workers
    if (config.getoption("--gpu-only") and config.pluginmanager.hasplugin("xdist")
            and config.getoption("numprocesses", None) is None and config.getoption("dist", "no") == "no"):
        config.option.numprocesses = GPU_WORKERS   # what -n 4 sets (xdist reads -n before this hook)
        config.option.tx = ["popen"] * GPU_WORKERS
        config.option.dist = "load"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long end-to-end or interpreter tests (`-m \"not slow\"` skips them)")


def pytest_collection_modifyitems(config, items):
    """Marks the long tests slow; --gpu-only keeps the tests whose skip condition names a GPU (the rest
    run in CI anyway)."""
    for item in items:
        path = item.nodeid.split("::")[0]
        if path.startswith(SLOW_FILES) or SLOW_NAMES.search(item.name):
            item.add_marker(pytest.mark.slow)
    if not config.getoption("--gpu-only"):
        return
    needs_gpu = [item for item in items
                 if any(GPU_REASON.search(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif"))]
    config.hook.pytest_deselected(items=[item for item in items if item not in needs_gpu])
    items[:] = needs_gpu


def pytest_ignore_collect(collection_path, config):
    """--gpu-only leaves tests/serve out: none of its tests needs a GPU (CI runs them), and a GPU box
    may lack the API clients and the server's packages that its conftest imports."""
    if config.getoption("--gpu-only") and collection_path.name == "serve" and collection_path.parent.name == "tests":
        return True
    return None


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """arch → (folder, transformers model) for every supported family, built once per session."""
    from tiny_models import ARCHS, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, make_tiny_checkpoint(arch, root / arch)) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_checkpoints):
    return tiny_checkpoints["qwen3_moe"][0]


@pytest.fixture(scope="session")
def tiny_quant_checkpoints(tmp_path_factory):
    """arch → (folder, transformers model): tiny checkpoints whose widths fit quantization groups of 32 and 64
    (the families whose experts can be quantized)."""
    from tiny_models import QUANT_ARCHS, make_quant_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_quant")
    return {arch: (root / arch, make_quant_tiny_checkpoint(root / arch, arch=arch)) for arch in QUANT_ARCHS}


@pytest.fixture(scope="session")
def tiny_quant(tiny_quant_checkpoints):
    return tiny_quant_checkpoints["qwen3_moe"][0]
