"""CPU kernels compiled from this folder's C++ and called through the XLA FFI.

One kernel today, `gae_cpu.cc`: skip-observation GAE as a single pass over each row. It is built
on first use with the system C++ compiler (`$CXX`, else `c++`) against the XLA FFI headers that
ship with jaxlib, cached as `<cache>/gae_cpu-<hash>.so` (the hash covers the source, the jaxlib
version and the compiler), then registered with `jax.ffi.register_ffi_target` for the CPU
platform. `<cache>` is `$SAO_JAX_KERNEL_CACHE`, else `$XDG_CACHE_HOME/sao_jax/kernels`, else
`~/.cache/sao_jax/kernels`. Concurrent builds (several processes) each write a private file and
rename it into place, so a reader never sees half a library.

Without a compiler the kernel is unavailable: `gae_kernel_available()` says so, logs why once, and
`skip_observation_gae(method="auto")` falls back to the `lax.scan` path (same results).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

logger = logging.getLogger(__name__)

GAE_TARGET = "sao_skip_observation_gae"
_SOURCE = Path(__file__).with_name("gae_cpu.cc")


def kernel_cache_dir() -> Path:
    if "SAO_JAX_KERNEL_CACHE" in os.environ:
        return Path(os.environ["SAO_JAX_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sao_jax" / "kernels"


def _build(source: Path) -> Path:
    """Compiles `source` into a shared library in the cache (once per source/jaxlib/compiler)."""
    compiler = os.environ.get("CXX", "c++")
    compiler_path = shutil.which(compiler)
    if compiler_path is None:
        raise RuntimeError(f"no C++ compiler found (looked for {compiler!r}; set $CXX)")
    text = source.read_bytes()
    key = hashlib.sha256(text + jaxlib.__version__.encode() + compiler_path.encode()).hexdigest()
    library = kernel_cache_dir() / f"{source.stem}-{key[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        command = [compiler_path, "-O3", "-std=c++17", "-fPIC", "-shared",
                   "-isystem", jax.ffi.include_dir(), str(source), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed:\n{' '.join(command)}\n"
                               f"{result.stderr[-4000:]}")
        os.replace(built, library)  # atomic: a concurrent builder's file is replaced, not mixed
    return library


@functools.cache
def gae_kernel_available() -> bool:
    """Builds and registers the GAE kernel (once per process); False, logged, if that fails."""
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(_SOURCE)))
        jax.ffi.register_ffi_target(GAE_TARGET, jax.ffi.pycapsule(library.SaoSkipObservationGae),
                                    platform="cpu")
    except (OSError, RuntimeError) as error:
        logger.warning("the CPU GAE kernel is unavailable, using the lax.scan path: %s", error)
        return False
    return True
