"""Targets: the host CPU as default, user strings/dicts parsed, threads sized to the physical cores, and the
facts CPU schedules derive their defaults from (``cpu_info``), all read from the target and the table
``schedules/cpu_targets.json``, never from the machine running the compiler (only ``host_target`` looks at
the host: it puts the host's CPU and cores *into* a target)."""
from __future__ import annotations

import functools
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from . import _compat as C
from .errors import TargetError


def physical_cores() -> int:
    """Physical cores of this host (hyper-threads do not help TVM's compute-bound kernels)."""
    try:
        import psutil
    except ImportError:          # psutil is optional: without it, the logical CPUs
        return os.cpu_count() or 1
    n = psutil.cpu_count(logical=False)
    return int(n) if n else (os.cpu_count() or 1)


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


def runs_on_host(target: C.Target) -> bool:
    """Whether code built for the llvm ``target`` runs on this machine: the same architecture and every CPU
    feature LLVM enables for the target (avx512f, avx2, fma, ...) present in the host's.  Code for a target
    with a feature the host lacks dies with SIGILL (an AVX-512 build on an AVX2 host), so tests and tools that
    run what they build for a named target ask this first."""
    if str(target.kind.name) != "llvm":
        return False
    host = host_target()
    triple = str(target.attrs.get("mtriple", "") or C.llvm_system_triple())
    if triple.split("-")[0] != str(host.attrs["mtriple"]).split("-")[0]:
        return False
    return isa_features(target) <= isa_features(host)


# LLVM's feature list of a CPU mixes instruction-set extensions with tuning flags (fast-*, slow-*,
# false-deps-*, prefer-256-bit, ...) that no host "has"; these prefixes are the extensions generated code may
# use (an AVX2 host lacks skylake-avx512's avx512f, and no x86 host lists skylake's tuning flags)
ISA_FEATURE_PREFIXES = ("avx", "sse", "ssse", "fma", "f16c", "bmi", "amx", "gfni", "vaes", "vpclmulqdq", "sha",
                        "aes", "pclmul", "lzcnt", "popcnt", "movbe", "adx", "cx16", "evex512", "neon", "sve",
                        "fp16", "bf16", "dotprod", "i8mm")


def isa_features(target: C.Target) -> set[str]:
    """The instruction-set extensions LLVM enables for ``target`` (``ISA_FEATURE_PREFIXES``)."""
    return {f for f in C.llvm_cpu_features(target) if f.startswith(ISA_FEATURE_PREFIXES)}


_ALIASES = {
    "host": None,
    "cpu": None,
    "native": None,
    "cuda": {"kind": "cuda", "arch": "sm_90"},
    "aarch64": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]},
}


_INT_ATTRS = ("num-cores", "max_num_threads", "thread_warp_size")


def _cli_target(text: str) -> dict:
    """TVM's former command-line form (``llvm -mcpu=skylake-avx512 -num-cores=32 -mattr=+avx2,+fma``),
    which TVM 0.27 no longer parses, as the dict form it takes."""
    kind, *opts = text.split()
    spec: dict = {"kind": kind}
    for opt in opts:
        if not opt.startswith("-") or "=" not in opt:
            raise TargetError(f"target {text!r}: option {opt!r} is not of the form -key=value")
        k, v = opt[1:].split("=", 1)
        spec[k] = int(v) if k in _INT_ATTRS else v.split(",") if k in ("mattr", "libs", "keys") else v
    return spec


def parse_target(target=None) -> C.Target:
    """Accept None/'host' (this CPU), a Target, a dict, a JSON string, an alias (``aarch64``, ``cuda``),
    or a target string (``llvm -mcpu=haswell -num-cores=2``, TVM's former command-line form)."""
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
            try:
                target = json.loads(key)
            except json.JSONDecodeError as e:
                raise TargetError(f"target {key!r} is not valid JSON: {e}") from None
        elif " -" in key:
            target = _cli_target(key)
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
    """What the CPU schedules derive their untuned defaults from: facts of the *target*, never of the host
    (a compile for a named target gives the same kernels on every machine)."""

    vector_bits: int
    cores: int
    l1d_bytes: int
    l2_bytes: int
    has_fma: bool
    mcpu: str = "generic"          # the target's LLVM CPU name ("generic" when it names none)
    table_entry: str = "generic"   # the row of schedules/cpu_targets.json the caches came from

    @property
    def float32_lanes(self) -> int:
        return self.vector_bits // 32


# --------------------------------------------------------------------------- target tables (data)
CPU_TABLE = "cpu_targets.json"


def data_dirs(name: str) -> list[Path]:
    """Where a top-level data folder of the project (``schedules``, ``tuning_logs``) is: the folder next to
    the package in a source checkout, or ``<prefix>/share/tvmfuse/<name>`` where a wheel installs it
    (``[tool.setuptools.data-files]`` in pyproject.toml). Existing folders only, checkout first."""
    import sys
    import sysconfig

    pkg = Path(__file__).resolve().parent
    candidates = [pkg.parent / name,
                  Path(sysconfig.get_path("data")) / "share" / "tvmfuse" / name,
                  Path(sys.prefix) / "share" / "tvmfuse" / name]
    seen, out = set(), []
    for d in candidates:
        if d.is_dir() and d.resolve() not in seen:
            seen.add(d.resolve())
            out.append(d)
    return out


_TABLE_KEYS = ("default_num_cores", "generic_by_vector_bits", "cpus", "template_defaults")
_ENTRY_KEYS = ("l1d_kib", "l2_kib")


@functools.lru_cache(maxsize=None)
def cpu_table() -> dict:
    """``schedules/cpu_targets.json``, checked: a missing file or field is an error naming it."""
    dirs = data_dirs("schedules")
    path = next((d / CPU_TABLE for d in dirs if (d / CPU_TABLE).is_file()), None)
    if path is None:
        raise TargetError(f"the CPU target table {CPU_TABLE} is not installed (looked in "
                          f"{[str(d) for d in dirs] or 'no schedules/ folder'})")
    try:
        table = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TargetError(f"cannot read the CPU target table {path}: {e}") from None
    missing = [k for k in _TABLE_KEYS if k not in table]
    if missing:
        raise TargetError(f"{path}: missing field(s) {missing}")
    rows = [(f"cpus.{k}", v) for k, v in table["cpus"].items()] + \
        [(f"generic_by_vector_bits.{k}", v) for k, v in table["generic_by_vector_bits"].items()]
    for key, entry in rows:
        bad = [k for k in _ENTRY_KEYS if not isinstance(entry.get(k), int) or entry[k] <= 0]
        if bad:
            raise TargetError(f"{path}: {key} needs positive integer field(s) {bad}")
    aliases = {}
    for name, entry in table["cpus"].items():
        for a in entry.get("aliases", ()):
            aliases[a] = name
    table["_aliases"] = aliases
    table["_path"] = str(path)
    return table


def _table_entry(mcpu: str, bits: int) -> tuple[str, dict]:
    table = cpu_table()
    name = table["_aliases"].get(mcpu, mcpu)
    if name in table["cpus"]:
        return name, table["cpus"][name]
    generic = table["generic_by_vector_bits"]
    if str(bits) not in generic:
        raise TargetError(f"{table['_path']}: no generic_by_vector_bits entry for {bits}-bit vectors")
    return f"generic_by_vector_bits.{bits}", generic[str(bits)]


def _vector_bits(feats: set[str]) -> int:
    if "avx512f" in feats:
        return 512
    if "avx" in feats:       # AVX (and AVX2): 256-bit float vectors
        return 256
    return 128               # SSE, NEON


def default_num_cores() -> int:
    """Cores assumed for a target without a ``num-cores`` attribute (the table's ``default_num_cores``)."""
    return int(cpu_table()["default_num_cores"])


def cpu_info(target: C.Target) -> CPUInfo:
    """Everything from the target: vector width and FMA from its mcpu/mattr (LLVM's feature list), cores
    from its ``num-cores`` (else the table's default), caches from the table row of its mcpu (else the
    generic row of its vector width).  Nothing is read from the machine running the compiler."""
    key = str(target)
    info = _CPU_INFO.get(key)
    if info is None:
        info = _CPU_INFO[key] = _cpu_info(target)
    return info


_CPU_INFO: dict[str, CPUInfo] = {}     # target JSON -> its CPUInfo (templates ask several times per kernel)


def _cpu_info(target: C.Target) -> CPUInfo:
    llvm = target.kind.name == "llvm"
    feats = C.llvm_cpu_features(target) if llvm else set()
    bits = _vector_bits(feats)
    mcpu = str(target.attrs.get("mcpu", "") or "generic") if llvm else "generic"
    entry_name, entry = _table_entry(mcpu, bits)
    cores = int(target.attrs.get("num-cores", 0) or 0) or default_num_cores()
    return CPUInfo(
        vector_bits=bits,
        cores=cores,
        l1d_bytes=int(entry["l1d_kib"]) * 1024,
        l2_bytes=int(entry["l2_kib"]) * 1024,
        has_fma="fma" in feats or "neon" in feats,   # NEON always has fused multiply-add (fmla)
        mcpu=mcpu,
        table_entry=entry_name,
    )


def template_defaults(target: C.Target, family: str) -> dict:
    """Default knob values and thresholds of template ``family`` for ``target``: the table's
    ``template_defaults[family]``, overridden by the target's CPU row where it has its own."""
    table = cpu_table()
    if family not in table["template_defaults"]:
        raise TargetError(f"{table['_path']}: no template_defaults for {family!r}")
    out = dict(table["template_defaults"][family])
    info = cpu_info(target)
    if info.table_entry in table["cpus"]:
        out.update(table["cpus"][info.table_entry].get("template_defaults", {}).get(family, {}))
    return out


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
