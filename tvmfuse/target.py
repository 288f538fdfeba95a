"""Targets: the host CPU as default, user strings/dicts parsed, threads sized to the physical cores."""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from . import _compat as C
from .errors import TargetError


def physical_cores() -> int:
    """Physical cores of this host (hyper-threads do not help TVM's compute-bound kernels)."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
        if n:
            return int(n)
    except ImportError:
        pass
    return os.cpu_count() or 1


def host_target(num_cores: int | None = None) -> C.Target:
    """An llvm target for this machine: its CPU (so AVX2/AVX-512 are used) and its physical cores."""
    machine = platform.machine()
    spec = {
        "kind": "llvm",
        "mcpu": C.llvm_system_cpu(),
        "mtriple": f"{machine}-unknown-linux-gnu" if platform.system() == "Linux" else C.llvm_system_triple(),
        "num-cores": int(num_cores or physical_cores()),
    }
    return C.Target(spec)


_ALIASES = {
    "host": None,
    "cpu": None,
    "native": None,
    "cuda": {"kind": "cuda", "arch": "sm_90"},
    "aarch64": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]},
}


def parse_target(target=None) -> C.Target:
    """Accept None/'host' (this CPU), a Target, a dict, a JSON string, or a TVM target string."""
    if target is None:
        return host_target()
    if isinstance(target, C.Target):
        return target
    if isinstance(target, str):
        key = target.strip()
        if key in _ALIASES:
            alias = _ALIASES[key]
            if alias is None:
                return host_target()
            if alias["kind"] == "cuda":
                return C.Target(alias, host=host_target())
            return C.Target(alias)
        if key.startswith("{"):
            import json

            try:
                target = json.loads(key)
            except json.JSONDecodeError as e:
                raise TargetError(f"target {key!r} is not valid JSON: {e}") from None
    try:
        tgt = C.Target(target)
    except Exception as e:  # TVM raises several error types for a bad target spec
        raise TargetError(f"cannot parse target {target!r}: {e}") from None
    if tgt.kind.name == "cuda" and tgt.host is None:
        tgt = C.Target(tgt, host=host_target())
    return tgt


def is_cpu(target: C.Target) -> bool:
    return target.kind.name in ("llvm", "c")


def is_gpu(target: C.Target) -> bool:
    return "gpu" in [str(k) for k in target.keys]


@dataclass(frozen=True)
class CPUInfo:
    """What the CPU schedules derive their untuned defaults from."""

    vector_bits: int
    cores: int
    l1d_bytes: int
    l2_bytes: int
    has_fma: bool

    @property
    def float32_lanes(self) -> int:
        return self.vector_bits // 32


def _cache_bytes(level: int, default: int) -> int:
    path = f"/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(path)):
            if not entry.startswith("index"):
                continue
            with open(os.path.join(path, entry, "level")) as f:
                lvl = int(f.read())
            with open(os.path.join(path, entry, "type")) as f:
                kind = f.read().strip()
            if lvl == level and kind in ("Data", "Unified"):
                with open(os.path.join(path, entry, "size")) as f:
                    s = f.read().strip()
                mult = {"K": 1024, "M": 1024 * 1024}.get(s[-1], 1)
                return int(s.rstrip("KM")) * mult
    except (OSError, ValueError):
        return default
    return default


def cpu_info(target: C.Target) -> CPUInfo:
    """Vector width from the target's CPU features; cores from the target; caches from this host."""
    feats = C.llvm_cpu_features(target) if target.kind.name == "llvm" else set()
    if "avx512f" in feats:
        bits = 512
    elif "avx2" in feats or "avx" in feats:
        bits = 256
    else:
        bits = 128
    cores = int(target.attrs.get("num-cores", 0) or physical_cores())
    return CPUInfo(
        vector_bits=bits,
        cores=cores,
        l1d_bytes=_cache_bytes(1, 32 * 1024),
        l2_bytes=_cache_bytes(2, 1024 * 1024),
        has_fma="fma" in feats,
    )


def configure_threads(num_threads: int | None = None) -> int:
    """Size TVM's runtime thread pool: the user's choice, else TVM_NUM_THREADS, else physical cores.

    TVM creates its pool once per process, on first use, with ``TVM_NUM_THREADS`` workers or else half
    the logical CPUs on x86 (it assumes hyper-threading: a 2-vCPU VM gets 1 worker), and
    ``runtime.config_threadpool`` can only choose up to that many.  So the pool size is put in the
    environment before the first call creates the pool.  Returns the number of threads TVM now uses.
    """
    env = os.environ.get("TVM_NUM_THREADS")
    if num_threads is None:
        num_threads = int(env) if env else physical_cores()
    if not env:
        os.environ["TVM_NUM_THREADS"] = str(max(int(num_threads), physical_cores()))
    C.set_runtime_threads(num_threads)
    used = C.runtime_threads()
    if used != num_threads:
        import logging

        logging.getLogger("tvmfuse").warning(
            "TVM runtime uses %d threads, not %d: its pool was created before tvmfuse sized it "
            "(set TVM_NUM_THREADS before the first TVM call)", used, num_threads)
    return used
