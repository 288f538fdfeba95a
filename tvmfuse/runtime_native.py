"""run()'s native step: the VM call and its numpy result in C (issue 11), built at first use.

After a kernel that streamed megabytes through the caches, each Python step of ``run()`` after the VM call
(tvm-ffi's result wrapper, the reference-count read, the DLPack export and numpy's import of it, the dict)
runs with its code and data evicted (io10: ~890 extra L2 misses, ~2.5 us per call, 5-8% of layernorm's
45 us call).  ``runtime_native.c`` does that part in one C function: it calls the VM function through
tvm-ffi's C API (GIL released, as tvm-ffi's Python call does) and wraps the result tensor as a numpy
array directly (its base holds the tensor), with the same rules as the Python path (a tensor the VM also
holds elsewhere, or the input's own memory, is copied).

Built once per (source, Python, numpy, tvm-ffi) into the cache directory (``TVMFUSE_CACHE_DIR``, else
``~/.cache/tvmfuse``) with the C compiler Python was built with (``CC`` overrides), at the first ``run()``
of a model that can use it (a one-output static model on a CPU: call_one for one input, call_many for
several); about 1 s.  When it cannot be
built or loaded (no compiler, no headers, a read-only cache), ``run()`` takes the Python path, which does
the same (``reason()`` says why; logged once at INFO).  ``TVMFUSE_NATIVE_IO=0`` turns it off.

The same extension holds numpy's 64-byte aligned allocator (``set_aligned_handler``; NEP 49), which
``tvmfuse.io.aligned_numpy`` installs (by default when the first CPU model is compiled or loaded).
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile

import numpy as np

from . import _compat as C

_LOG = logging.getLogger(__name__)
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runtime_native.c")
_MODULE = "_tvmfuse_native_io"
ENV_SWITCH = "TVMFUSE_NATIVE_IO"          # "0": never use the native step
MAX_INPUTS = 64                           # call_many's most inputs (runtime_native.c's MAX_INPUTS)
BUILD_TIMEOUT_S = 120                     # a compile that takes longer is given up (the Python path runs)

_state: dict = {}                         # "module": the loaded extension or None, "reason": why None


def _cache_dir() -> str:
    root = os.environ.get("TVMFUSE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tvmfuse")
    return os.path.join(root, "native")


def _build_key(source: bytes) -> str:
    h = hashlib.sha256(source)
    for part in (sys.version, np.__version__, C.TVM_FFI_VERSION, sysconfig.get_platform()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _compile(source_path: str, out_path: str) -> None:
    """Compile the extension to ``out_path`` (atomically: a temporary file renamed); raises OSError or
    subprocess.CalledProcessError / TimeoutExpired with the compiler's message."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    includes, libdir, lib = C.tvm_ffi_build_paths()
    cmd = shlex.split(cc) + ["-O2", "-shared", "-fPIC", "-std=c11", "-o", None, source_path,
                             "-I", sysconfig.get_paths()["include"], "-I", np.get_include()]
    for inc in includes:
        cmd += ["-I", inc]
    cmd += ["-L", libdir, f"-l{lib}", f"-Wl,-rpath,{libdir}"]
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out_path))
    os.close(fd)
    cmd[cmd.index(None)] = tmp
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_from(path: str):
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, path)
    spec = importlib.util.spec_from_file_location(_MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load():
    """The extension module (its ``call_one``), built if needed; None when off or unavailable
    (``reason()``).  Tried once per process."""
    if "module" in _state:
        return _state["module"]
    module, reason = None, None
    if os.environ.get(ENV_SWITCH, "1") == "0":
        reason = f"turned off ({ENV_SWITCH}=0)"
    else:
        try:
            with open(_SOURCE, "rb") as f:
                source = f.read()
            path = os.path.join(_cache_dir(), _build_key(source), _MODULE + (sysconfig.get_config_var("EXT_SUFFIX")
                                                                            or ".so"))
            if not os.path.exists(path):
                _compile(_SOURCE, path)
            module = _load_from(path)
        except subprocess.CalledProcessError as e:
            reason = f"build failed: {' '.join(e.cmd[:1])} exited {e.returncode}: {(e.stderr or '').strip()[-400:]}"
        except subprocess.TimeoutExpired:
            reason = f"build took over {BUILD_TIMEOUT_S} s"
        except (OSError, ImportError) as e:
            reason = f"cannot build or load it: {type(e).__name__}: {e}"
    if module is None:
        _LOG.info("tvmfuse: run()'s native step unavailable, the Python path runs (%s)", reason)
    _state["module"], _state["reason"] = module, reason
    return module


def reason() -> str | None:
    """Why the native step is not used (None: it is, or ``load()`` was not called yet)."""
    return _state.get("reason")


def numpy_typenum(dtype) -> int | None:
    """numpy's type number of ``dtype`` when the native step can produce it (the dtypes of
    ``runtime_native.c``'s ``dl_typenum``), else None."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "fiub" or not dtype.isnative or dtype.itemsize not in (1, 2, 4, 8):
        return None
    if dtype.kind == "f" and dtype.itemsize == 1 or dtype.kind == "b" and dtype.itemsize != 1:
        return None
    return dtype.num


def _reset_for_tests(enabled: bool | None = None) -> None:
    """Forget what ``load()`` found (tests: the next load tries again, or is off when ``enabled`` is
    False)."""
    _state.clear()
    if enabled is False:
        _state["module"], _state["reason"] = None, "turned off by a test"
