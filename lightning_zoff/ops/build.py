"""JIT build of the package's csrc/ with torch.utils.cpp_extension.load (ninja), cached per source version, machine
and torch."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from importlib import resources
from pathlib import Path
from types import ModuleType

import torch
from torch.utils import cpp_extension

# The C++ sources ship inside the package, so an installed wheel builds from its own copy (a checkout's top-level
# csrc/ is a link to this directory). Path(): the compiler needs files on disk (no zipped installs).
CSRC = Path(str(resources.files("lightning_zoff") / "csrc"))
_NAME = "zoff_cpu_kernels"
_SOURCES = ("bindings.cpp", "isa.cpp", "stream_probe.cpp", "isa_scalar.cpp", "isa_avx2.cpp", "isa_avx512.cpp")
# -ffp-contract=off: g++ fuses a*b+c into one FMA by default, which would round differently per ISA; with it off every
# build rounds each operation like the scalar path, so all ISAs give bitwise-equal results.
# -fno-math-errno: sqrt compiles to the instruction alone (nothing reads errno).
_CFLAGS = ("-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off", "-fno-math-errno")
# libstdc++ named explicitly: on the GPU image (torch 2.11 cu130, g++ 13) the default link left libstdc++.so.6 out of
# the module's NEEDED list (--as-needed; the module held its own copies of the iostream templates), and formatting
# an integer into an error message then segfaulted inside num_put. With the library named, it is a dependency.
_LDFLAGS = ("-fopenmp", "-l:libstdc++.so.6")

_log = logging.getLogger("lightning_zoff")  # one logger for all of zoff (node_log filters it)
_lock = threading.Lock()
_module: ModuleType | None = None


def load() -> ModuleType:
    """The compiled kernels module: built on first use (one line on stderr while it builds), then cached."""
    global _module
    with _lock:
        if _module is None:
            _module = _build()
        return _module


def cache_dir() -> Path:
    """Where this source version, machine and torch keep their build (a new key never reuses another's objects)."""
    root = Path(os.environ.get("ZOFF_CACHE_DIR") or Path.home() / ".cache" / "lightning_zoff")
    return root / _build_key()


def _build() -> ModuleType:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(
            f"lightning_zoff builds its CPU optimizer kernels on first use and needs a C++ compiler, but {cxx!r} was"
            " not found. Install g++ (e.g. `apt-get install g++`, `dnf install gcc-c++` or"
            " `conda install -c conda-forge gxx`), or point the CXX environment variable at one"
            " (`export CXX=/path/to/g++`)."
        )
    build_dir = cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / f"{_NAME}.so").exists():
        _log.info("lightning_zoff: building CPU kernels (first use, ~30 s) into %s", build_dir)
    # torch's load takes a file lock in build_dir, so processes starting together build once and all import it.
    return cpp_extension.load(
        name=_NAME,
        sources=[str(CSRC / source) for source in _SOURCES],
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )


def _build_key() -> str:
    # the source directory too: ninja's build file names absolute paths, so two checkouts sharing one directory
    # would rebuild each other's extension on every start
    digest = hashlib.sha256(str(CSRC.resolve()).encode() + b"\0")
    for path in sorted(CSRC.glob("*.[ch]*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    # the CPU's SIMD level too (torch's "AVX512", "AVX2", "DEFAULT", ...), so a cache shared between machines never
    # mixes them; which kernel build runs is decided at run time by the module itself (csrc/isa.cpp)
    machine = (platform.machine(), torch.backends.cpu.get_cpu_capability())
    toolchain = (_CFLAGS, _LDFLAGS, os.environ.get("CXX", "c++"), torch.__version__, sys.implementation.cache_tag)
    digest.update(repr((machine, toolchain)).encode())
    return digest.hexdigest()[:16]

