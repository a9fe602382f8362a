"""CPU kernels compiled from this folder's C++ and called through the XLA FFI: an optional accelerator
for XLA:CPU, which nothing on other platforms runs.

Four kernels: `gae_cpu.cc`, skip-observation GAE as a single pass over each row (`advantages`,
method "kernel"); and three for the sampler's `native_cpu` decode backend (`sao_jax.rollout.decode`;
their calls from JAX are in `decode.py`): `cached_attention_cpu.cc`, a decode step's attention over
the KV cache read in place; `expert_swiglu_cpu.cc`, a decode step's routed experts (each chosen
expert's SwiGLU on its tokens, summed per token, on the weights as `decode.pack_experts` lays them
out); and `few_rows_matmul_cpu.cc`, a decode step's projections (a few rows times a weight matrix).
Each is built on first use with the system C++ compiler (`$CXX`, else `c++`) against the XLA FFI
headers that ship with jaxlib, for this machine's CPU (`-march=native`), cached as
`<cache>/<name>-<hash>.so` (the hash covers the source and this folder's headers, the jaxlib version,
the compiler and the CPU), then registered with `jax.ffi.register_ffi_target` for the CPU platform.
`<cache>` is `$SAO_JAX_KERNEL_CACHE`, else `$XDG_CACHE_HOME/sao_jax/kernels`, else
`~/.cache/sao_jax/kernels`. Concurrent builds (several processes) each write a private file and
rename it into place, so a reader never sees half a library.

Without a compiler a kernel is unavailable: `gae_kernel_available()`, `cached_attention_available()`,
`expert_swiglu_available()` and `few_rows_matmul_available()` say so, log why once, and the callers
fall back to XLA (same results).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

logger = logging.getLogger(__name__)

GAE_TARGET = "sao_skip_observation_gae"
CACHED_ATTENTION_TARGET = "sao_cached_attention"
EXPERT_SWIGLU_PACKED_TARGET = "sao_expert_swiglu_packed"
FEW_ROWS_MATMUL_TARGET = "sao_few_rows_matmul"
_HERE = Path(__file__).parent


def kernel_cache_dir() -> Path:
    if "SAO_JAX_KERNEL_CACHE" in os.environ:
        return Path(os.environ["SAO_JAX_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sao_jax" / "kernels"


def _cpu_identity() -> bytes:
    """The CPU a `-march=native` build is for (model and feature flags), so that machines sharing a
    cache folder never load each other's libraries."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()
    wanted = {"model name", "flags", "Features", "CPU implementer", "CPU part"}
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted})).encode()


def _build(source: Path) -> Path:
    """Compiles `source` into a shared library in the cache (once per source, jaxlib, compiler and
    CPU: the kernels are built for the CPU they run on)."""
    compiler = os.environ.get("CXX", "c++")
    compiler_path = shutil.which(compiler)
    if compiler_path is None:
        raise RuntimeError(f"no C++ compiler found (looked for {compiler!r}; set $CXX)")
    text = source.read_bytes() + b"".join(header.read_bytes() for header in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(text + jaxlib.__version__.encode() + compiler_path.encode() + _cpu_identity()).hexdigest()
    library = kernel_cache_dir() / f"{source.stem}-{key[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        native_cpu = "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native"
        command = [compiler_path, "-O3", native_cpu, "-std=c++17", "-fPIC", "-shared",
                   "-isystem", jax.ffi.include_dir(), str(source), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed:\n{' '.join(command)}\n"
                               f"{result.stderr[-4000:]}")
        os.replace(built, library)  # atomic: a concurrent builder's file is replaced, not mixed
    return library


def _register(source: str, symbol: str, target: str, fallback: str) -> bool:
    """Builds `source` and registers its handler `symbol` as the CPU FFI target `target`; False,
    logged with what the caller does instead, if that fails."""
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(_HERE / source)))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (OSError, RuntimeError) as error:
        logger.warning("the CPU kernel %s is unavailable, %s: %s", source, fallback, error)
        return False
    return True


@functools.cache
def gae_kernel_available() -> bool:
    """Builds and registers the GAE kernel (once per process); False, logged, if that fails."""
    return _register("gae_cpu.cc", "SaoSkipObservationGae", GAE_TARGET, "using the lax.scan path")


@functools.cache
def cached_attention_available() -> bool:
    """Builds and registers the cached-attention kernel (once per process); False, logged, if that
    fails."""
    return _register("cached_attention_cpu.cc", "SaoCachedAttention", CACHED_ATTENTION_TARGET,
                     "decoding with the einsum attention")


@functools.cache
def expert_swiglu_available() -> bool:
    """Builds and registers the experts' SwiGLU kernel (once per process); False, logged, if that
    fails."""
    return _register("expert_swiglu_cpu.cc", "SaoExpertSwigluPacked", EXPERT_SWIGLU_PACKED_TARGET,
                     "running the decode steps' experts through XLA's dispatch")


@functools.cache
def few_rows_matmul_available() -> bool:
    """Builds and registers the few-rows matmul kernel (once per process); False, logged, if that
    fails."""
    return _register("few_rows_matmul_cpu.cc", "SaoFewRowsMatmul", FEW_ROWS_MATMUL_TARGET,
                     "running the decode steps' projections as XLA dots")
