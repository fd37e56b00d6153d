"""Finding, loading and registering the native collectives' FFI library
(:mod:`magi_jax.sharding.native`), and whether a platform or a mesh can run it."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

_LIBS = {"cpu": "_magi_native_cpu.so", "cuda": "_magi_native_cuda.so"}
CAST_TARGET, REDUCE_TARGET = "magi_group_cast", "magi_group_reduce"
START_TARGET, DONE_TARGET = "magi_group_reduce_start", "magi_group_reduce_done"


class NativeUnavailable(RuntimeError):
    """The native library for a platform cannot be used (the message says why)."""


def platform_key(platform: str) -> str:
    p = platform.lower()
    return "cuda" if p in ("cuda", "gpu", "rocm") else p


def _search_dirs():
    # The build installs the libraries into the magi_jax package folder (CMakeLists.txt),
    # three levels above this module (magi_jax/sharding/transport/native/).
    here = Path(__file__).resolve().parents[3]
    seen = [here]
    for p in sys.path:
        d = Path(p or ".").resolve() / "magi_jax"
        if d not in seen:
            seen.append(d)
    extra = os.environ.get("MAGI_JAX_NATIVE_DIR")
    if extra:
        seen.insert(0, Path(extra))
    return seen


def find_library(name: str) -> Path | None:
    for d in _search_dirs():
        if (d / name).is_file():
            return d / name
    return None


def _capsule(ptr: int):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ptr, None, None)


@functools.cache
def load_library(platform: str) -> ctypes.CDLL:
    """Loads and registers the library of ``platform`` ('cpu' or 'cuda'); raises
    :class:`NativeUnavailable` with the reason."""
    name = _LIBS.get(platform)
    if name is None:
        raise NativeUnavailable(f"no native group collectives for platform {platform!r}")
    path = find_library(name)
    if path is None:
        hint = (
            "install the package with `pip install -e .` (it compiles ffi/ with CMake)"
            if platform == "cpu"
            else "it is built when nvcc and the NVSHMEM headers (pip install "
            "nvidia-nvshmem-cu13) are present at install time, or with "
            "-C cmake.define.MAGI_JAX_CUDA=ON"
        )
        raise NativeUnavailable(
            f"{name} was not found next to magi_jax ({_search_dirs()[0]}) or on sys.path; {hint}"
        )
    if platform == "cuda":
        _preload_nvshmem()
    try:
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise NativeUnavailable(f"could not load {path}: {e}") from e
    plat = "cpu" if platform == "cpu" else "CUDA"
    if platform == "cpu":
        for target, sym in (
            (CAST_TARGET, "MagiGroupCastCpu"),
            (REDUCE_TARGET, "MagiGroupReduceCpu"),
            (START_TARGET, "MagiGroupReduceStartCpu"),
            (DONE_TARGET, "MagiGroupReduceDoneCpu"),
        ):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, sym)), platform=plat)
    else:
        lib.MagiNvStateTypeId.restype = ctypes.c_void_p
        lib.MagiNvStateTypeInfo.restype = ctypes.c_void_p
        jax.ffi.register_ffi_type(
            "magi_jax.nvshmem_collective_state",
            {
                "type_id": _capsule(lib.MagiNvStateTypeId()),
                "type_info": _capsule(lib.MagiNvStateTypeInfo()),
            },
            platform=plat,
        )
        for target, stem in (
            (CAST_TARGET, "MagiGroupCastCuda"),
            (REDUCE_TARGET, "MagiGroupReduceCuda"),
            (START_TARGET, "MagiGroupReduceStartCuda"),
            (DONE_TARGET, "MagiGroupReduceDoneCuda"),
        ):
            jax.ffi.register_ffi_target(
                target,
                {
                    "instantiate": jax.ffi.pycapsule(getattr(lib, stem + "Instantiate")),
                    "execute": jax.ffi.pycapsule(getattr(lib, stem + "Execute")),
                },
                platform=plat,
            )
        lib.magi_nv_uid_size.restype = ctypes.c_int
        lib.magi_nv_get_uid.argtypes = [ctypes.c_void_p]
        lib.magi_nv_init.argtypes = [
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        lib.magi_nv_finalize.restype = ctypes.c_int
    return lib


def _preload_nvshmem():
    """Loads libnvshmem_host.so.3 from the nvidia-nvshmem-cu13 wheel (the CUDA library links
    it by soname) and points NVSHMEM at its bootstrap plugin."""
    try:
        import nvidia.nvshmem as m
    except ImportError as e:
        raise NativeUnavailable(
            "the CUDA handlers need NVSHMEM at run time: pip install nvidia-nvshmem-cu13"
        ) from e
    lib_dir = Path(list(m.__path__)[0]) / "lib"
    host = sorted(lib_dir.glob("libnvshmem_host.so*"))
    if not host:
        raise NativeUnavailable(f"libnvshmem_host.so not found in {lib_dir}")
    uid_plugin = lib_dir / "nvshmem_bootstrap_uid.so.3"
    if uid_plugin.exists():
        os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_PLUGIN", str(uid_plugin))
    ctypes.CDLL(str(host[0]), mode=ctypes.RTLD_GLOBAL)


def unavailable_reason(platform: str | None = None) -> str | None:
    """``None`` when the native collectives can run on ``platform`` (default: JAX's default
    backend), else why not."""
    try:
        load_library(platform_key(platform or jax.default_backend()))
    except NativeUnavailable as e:
        return str(e)
    return None


def available(platform: str | None = None) -> bool:
    """Whether the native library for ``platform`` (default: JAX's default backend) loads."""
    return unavailable_reason(platform) is None


def gpu_mesh_problem(mesh: Mesh, cp_axis: str) -> str | None:
    """Why ``mesh`` of GPUs cannot run the CUDA native transport on ``cp_axis`` (``None`` when
    it can): one GPU per process, the cp axis spanning every process in process order."""
    if jax.local_device_count() != 1:
        return (
            f"this process drives {jax.local_device_count()} GPUs; NVSHMEM needs one "
            "process per GPU (set CUDA_VISIBLE_DEVICES per process)"
        )
    if int(mesh.shape[cp_axis]) != jax.process_count() or mesh.devices.size != jax.process_count():
        return (
            f"the cp axis has {mesh.shape[cp_axis]} ranks over a mesh of {mesh.devices.size} "
            f"devices and {jax.process_count()} processes; the CUDA native transport "
            "supports a mesh whose only axis of size > 1 is the cp axis over all processes"
        )
    procs = [d.process_index for d in np.asarray(mesh.devices).reshape(-1)]
    if procs != list(range(len(procs))):
        return (
            f"the cp ranks sit on processes {procs}; the CUDA native transport needs rank r "
            "on process r (build the mesh from jax.devices() in order)"
        )
    return None


def check_mesh(mesh: Mesh, cp_axis: str) -> None:
    """Raises ``ValueError`` if ``comm_backend="native"`` cannot run on ``mesh``."""
    devices = list(np.asarray(mesh.devices).reshape(-1))
    plat = devices[0].platform
    if plat == "gpu":
        problem = gpu_mesh_problem(mesh, cp_axis) or unavailable_reason("cuda")
    else:
        problem = unavailable_reason(plat)
    if problem:
        raise ValueError(
            f"comm_backend='native' cannot run here: {problem}; use comm_backend='auto' or 'xla'"
        )
