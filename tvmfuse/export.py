"""Deployment artifacts: ``export`` writes one directory (or the same as one ``.tar``) holding the compiled
library, ahead-of-time device code and ``manifest.json``; ``load`` checks it and runs it with the TVM runtime.

Layout of an artifact (every file's sha256 is in the manifest; the manifest carries a digest of itself)::

    manifest.json          format version, inputs/outputs, target, versions, tuning log, fusion report, digests
    model.so               the Relax VM executable and its kernels (weights embedded as VM constants)
    device/kernels0.fatbin CUDA only: nvcc's sm_XX code for the kernels, so nothing is compiled at load time

Loading never imports onnx or calls a compiler: the library is dlopen'ed, and for CUDA the runtime's request
to compile kernel source is answered from ``device/`` by the source's sha256 (a source with no prebuilt code
is an error, not a compile).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import struct
import tarfile
import tempfile
import time
from dataclasses import asdict, is_dataclass

import numpy as np

from .errors import ArtifactError, InputError
from .io import Executes

FORMAT = "tvmfuse-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LIBRARY = "model.so"
DEVICE_DIR = "device"

# ELF e_machine values (System V ABI) of the architectures tvmfuse exports for.
_ELF_MACHINE = {62: "x86_64", 183: "aarch64", 40: "arm", 243: "riscv64", 190: "cuda"}
# platform.machine() and triple spellings of one architecture.
_ARCH_ALIASES = {"amd64": "x86_64", "x86-64": "x86_64", "arm64": "aarch64"}
# ISA extensions the code generator may emit. LLVM's other "features" of a CPU are tuning hints
# (slow-3ops-lea, fast-gather, prefer-256-bit, ...) that never make code fail on another CPU.
_ISA_FEATURE = re.compile(r"^(sse|ssse3|avx|fma|f16c|bmi|popcnt|lzcnt|movbe|aes|vaes|pclmul|vpclmulqdq|gfni"
                          r"|sha|amx|adx|evex512|neon|sve|sme|dotprod|fullfp16|fp16fml|bf16|i8mm|fp-armv8"
                          r"|crypto|crc|lse)")


# --------------------------------------------------------------------------- small helpers
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON without its own digest field."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _plain(x):
    """A TVM target's export() (ffi Maps/Arrays) as plain JSON values."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if hasattr(x, "items"):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) or (hasattr(x, "__len__") and hasattr(x, "__getitem__")):
        return [_plain(v) for v in x]
    return str(x)


def _norm_arch(arch: str) -> str:
    arch = arch.lower()
    return _ARCH_ALIASES.get(arch, arch)


def host_arch() -> str:
    return _norm_arch(platform.machine())


def elf_machine(path: str) -> str:
    """The architecture an ELF file is built for, from its header's e_machine."""
    with open(path, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF":
        raise ArtifactError(f"{path} is not an ELF shared library")
    endian = "<" if head[5] == 1 else ">"
    (machine,) = struct.unpack(endian + "H", head[18:20])
    return _ELF_MACHINE.get(machine, f"e_machine {machine}")


def fatbin_archs(data: bytes) -> list[tuple[str, int]]:
    """(kind, sm) of each entry of an NVIDIA fatbin: kind "sass" (cubin) or "ptx", sm e.g. 90."""
    magic = 0xBA55ED50
    entries = []
    pos = 0
    while pos + 16 <= len(data):
        m, _ver, header_size, body_size = struct.unpack_from("<IHHQ", data, pos)
        if m != magic:
            break
        off, end = pos + header_size, pos + header_size + body_size
        while off + 32 <= end:
            kind, _v, eh_size, size = struct.unpack_from("<HHIQ", data, off)
            (sm,) = struct.unpack_from("<I", data, off + 28)
            entries.append(({1: "ptx", 2: "sass"}.get(kind, f"kind{kind}"), int(sm)))
            if eh_size == 0:
                break
            off += eh_size + size
        pos = end
    return entries


# --------------------------------------------------------------------------- target description
def _triple_arch(target) -> str:
    """Architecture of the host code of ``target`` (an llvm target, or a GPU target's host)."""
    from . import _compat as C

    llvm = target if target.kind.name == "llvm" else target.host
    if llvm is None:
        return host_arch()
    triple = str(llvm.attrs.get("mtriple", "") or C.llvm_system_triple())
    return _norm_arch(triple.split("-")[0])


def _isa_features(target) -> list[str]:
    from . import _compat as C

    llvm = target if target.kind.name == "llvm" else target.host
    if llvm is None or llvm.kind.name != "llvm":
        return []
    return sorted(f for f in C.llvm_cpu_features(llvm) if _ISA_FEATURE.match(f))


def describe_target(target) -> dict:
    """What the manifest records about the target, and what load() checks against this host."""
    llvm = target if target.kind.name == "llvm" else target.host
    d = {
        "json": _plain(target.export()),
        "kind": target.kind.name,
        "arch": _triple_arch(target),
        "mtriple": str(llvm.attrs.get("mtriple", "")) if llvm is not None else "",
        "mcpu": str(llvm.attrs.get("mcpu", "")) if llvm is not None else "",
        "isa_features": _isa_features(target),
    }
    if target.kind.name == "cuda":
        d["cuda_arch"] = str(target.attrs.get("arch", ""))
    return d


# --------------------------------------------------------------------------- export
def _toolchain(arch: str):
    """fcompile for export_library: None (the default cc) on this architecture, else the cross gcc."""
    from . import _compat as C

    if arch == host_arch():
        return None
    cc = f"{arch}-linux-gnu-gcc"
    if shutil.which(cc) is None:
        raise ArtifactError(f"cross-compiling for {arch}: {cc} not found on PATH "
                            f"(Debian/Ubuntu: apt-get install gcc-{arch}-linux-gnu)")
    return C.cross_compiler(cc)


def _cuda_modules(module) -> list:
    out, stack = [], [module]
    while stack:
        m = stack.pop()
        if m.kind == "cuda":
            out.append(m)
        stack.extend(m.imports)
    return out


def _cuda_gencode(cuda_arch: str) -> list[str]:
    """nvcc flags: SASS for the target's sm (runs as is) and its PTX (the driver can JIT it for newer GPUs)."""
    m = re.fullmatch(r"sm_(\d+)([a-z]?)", cuda_arch)
    if not m:
        raise ArtifactError(f"CUDA target arch {cuda_arch!r} is not of the form sm_XX")
    v = m.group(1) + m.group(2)
    return ["-gencode", f"arch=compute_{v},code=sm_{v}", "-gencode", f"arch=compute_{v},code=compute_{v}"]


def _write_device_code(executable, target, root: str) -> list[dict]:
    """Compile each CUDA module's kernel source ahead of time; TVM 0.27 keeps only the source."""
    from . import _compat as C

    cuda_arch = str(target.attrs.get("arch", ""))
    entries = []
    os.makedirs(os.path.join(root, DEVICE_DIR), exist_ok=True)
    for i, m in enumerate(_cuda_modules(executable.mod)):
        source = m.inspect_source("")
        if not source:
            raise ArtifactError("a CUDA module of the executable has no kernel source to compile")
        try:
            fatbin = C.nvcc_compile(source, target, "fatbin", _cuda_gencode(cuda_arch))
        except (RuntimeError, OSError, ValueError) as e:
            raise ArtifactError(f"nvcc failed to compile the CUDA kernels for {cuda_arch}: {e}") from None
        rel = f"{DEVICE_DIR}/kernels{i}.fatbin"
        with open(os.path.join(root, rel), "wb") as f:
            f.write(fatbin)
        entries.append({"file": rel, "format": "fatbin", "arch": cuda_arch,
                        "code": [f"{k} sm_{sm}" for k, sm in fatbin_archs(fatbin)],
                        "source_sha256": hashlib.sha256(source.encode()).hexdigest()})
    return entries


def _tuning_log_info(path: str | None) -> dict | None:
    if not path:
        return None
    from .records import SHIPPED, shipped_logs

    if path == SHIPPED:
        return {"shipped": [{"path": str(p), "sha256": _sha256(str(p)), "bytes": p.stat().st_size}
                            for p in shipped_logs()]}
    if not os.path.isfile(path):
        raise ArtifactError(f"tuning log {path} used by this compile no longer exists; cannot record its digest")
    return {"path": os.path.abspath(path), "sha256": _sha256(path), "bytes": os.path.getsize(path)}


def _options_dict(options) -> dict:
    return json.loads(json.dumps(asdict(options) if is_dataclass(options) else {}, default=str))


def _write_tree(cm, root: str) -> dict:
    """Write the library, device code and manifest of ``cm`` into the empty directory ``root``."""
    from .version import __version__
    from . import _compat as C
    from .compiled import symbolic_dims

    target = cm.target
    tdesc = describe_target(target)
    lib = os.path.join(root, LIBRARY)
    try:
        cm.executable.export_library(lib, fcompile=_toolchain(tdesc["arch"]))
    except (RuntimeError, OSError, ValueError) as e:
        raise ArtifactError(f"linking the library for {tdesc['arch']} failed: {e}") from None
    built_for = elf_machine(lib)
    if built_for != tdesc["arch"]:
        raise ArtifactError(f"the linked library is for {built_for}, the target asks for {tdesc['arch']}")
    device_code = _write_device_code(cm.executable, target, root) if tdesc["kind"] == "cuda" else []
    files = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in sorted(names):
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root).replace(os.sep, "/")
            files[rel] = {"sha256": _sha256(p), "bytes": os.path.getsize(p)}
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": cm.report.model,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "inputs": [s.to_dict() for s in cm.inputs],
        "outputs": [s.to_dict() for s in cm.outputs],
        # symbolic dim -> where it sizes an input: run() takes any size there, equal across inputs
        "symbolic_dims": symbolic_dims(cm.inputs),
        # symbolic dim -> the largest size the memory plan holds (run() refuses larger: InputError)
        "shape_upper_bounds": dict(getattr(cm, "shape_upper_bounds", {}) or {}),
        "target": tdesc,
        "library": LIBRARY,
        "library_arch": built_for,
        "parameters": {"storage": "embedded", "detail": "weights are constants of the VM executable in "
                       f"{LIBRARY}; no separate parameter file"},
        "device_code": device_code,
        "versions": {"tvmfuse": __version__, "tvm": C.TVM_VERSION, "tvm_ffi": C.TVM_FFI_VERSION,
                     "python": platform.python_version()},
        "tuning_log": _tuning_log_info(getattr(cm.options, "tuning_log", None)),
        "pipeline_options": _options_dict(cm.options),
        "report": cm.report.to_dict(),
        "files": files,
    }
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    with open(os.path.join(root, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return manifest


def _is_tar(path: str) -> bool:
    return os.fspath(path).endswith(".tar")


def export(compiled_model, out: str) -> str:
    """Write ``compiled_model`` as an artifact at ``out`` (a directory, or one .tar if ``out`` ends in .tar).

    An existing artifact at ``out`` is replaced; any other existing file or non-empty directory is an error.
    Returns ``out``.
    """
    out = os.fspath(out)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, MANIFEST)):
        raise ArtifactError(f"{out} is a non-empty directory that is not a tvmfuse artifact; not overwriting")
    if os.path.exists(out) and not os.path.isdir(out) and not _is_tar(out):
        raise ArtifactError(f"{out} exists and is not an artifact directory; not overwriting")
    work = tempfile.mkdtemp(prefix=".tvmfuse-export-", dir=parent)
    try:
        tree = os.path.join(work, "artifact")
        os.mkdir(tree)
        _write_tree(compiled_model, tree)
        if _is_tar(out):
            partial = os.path.join(work, "artifact.tar")
            with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tf:
                for dirpath, _dirs, names in sorted(os.walk(tree)):
                    for n in sorted(names):
                        p = os.path.join(dirpath, n)
                        tf.add(p, arcname=os.path.relpath(p, tree).replace(os.sep, "/"), recursive=False)
            os.replace(partial, out)
        else:
            if os.path.isdir(out):
                shutil.rmtree(out)
            os.replace(tree, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def artifact_size(path: str) -> int:
    """Bytes of an artifact on disk (a .tar's size, or the sum of a directory's files)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, n)) for d, _s, ns in os.walk(path) for n in ns)


# --------------------------------------------------------------------------- load: checks
def _extract_tar(path: str, dest: str) -> None:
    """Extract regular files only, each inside ``dest`` (no links, devices or paths that climb out)."""
    try:
        with tarfile.open(path, "r:") as tf:
            for member in tf.getmembers():
                name = member.name
                if not member.isfile() and not member.isdir():
                    raise ArtifactError(f"{path}: member {name!r} is not a regular file")
                if os.path.isabs(name) or ".." in name.split("/"):
                    raise ArtifactError(f"{path}: member {name!r} points outside the artifact")
            tf.extractall(dest, filter="data")
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArtifactError(f"{path} is not a readable artifact .tar (truncated or corrupt): {e}") from None


def _read_manifest(root: str, shown: str) -> dict:
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        raise ArtifactError(f"{shown}: {MANIFEST} is missing; not a tvmfuse artifact")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{shown}: {MANIFEST} is not valid JSON (truncated or edited?): {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{shown}: {MANIFEST} is not a {FORMAT} manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise ArtifactError(f"{shown}: {MANIFEST} has no integer format_version")
    if version > FORMAT_VERSION:
        raise ArtifactError(f"{shown}: artifact format version {version} is newer than this tvmfuse reads "
                            f"(up to {FORMAT_VERSION}); upgrade tvmfuse to load it")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise ArtifactError(f"{shown}: {MANIFEST} does not match its recorded digest (edited or corrupt)")
    return manifest


def _verify_files(root: str, manifest: dict, shown: str) -> None:
    files = manifest.get("files")
    if not isinstance(files, dict) or manifest.get("library") not in files:
        raise ArtifactError(f"{shown}: {MANIFEST} lists no library file")
    for rel, info in sorted(files.items()):
        p = os.path.join(root, rel)
        if os.path.isabs(rel) or ".." in rel.split("/"):
            raise ArtifactError(f"{shown}: file {rel!r} of the manifest points outside the artifact")
        if not os.path.isfile(p):
            raise ArtifactError(f"{shown}: file {rel} is missing")
        size = os.path.getsize(p)
        if size != info.get("bytes"):
            raise ArtifactError(f"{shown}: file {rel} has {size} bytes, the manifest says {info.get('bytes')} "
                                "(truncated or replaced)")
        if _sha256(p) != info.get("sha256"):
            raise ArtifactError(f"{shown}: file {rel} does not match its sha256 in the manifest (tampered or "
                                "corrupt)")


def _cuda_compute_version(cuda_arch: str) -> tuple[int, int]:
    """sm_90 -> (9, 0), sm_90a -> (9, 0), sm_100 -> (10, 0)."""
    m = re.fullmatch(r"sm_(\d+)\d([a-z]?)", cuda_arch)
    if not m:
        raise ArtifactError(f"CUDA arch {cuda_arch!r} in the manifest is not of the form sm_XX")
    return int(m.group(1)), int(cuda_arch[3:].rstrip("abcdefghijklmnopqrstuvwxyz")[-1])


def check_host(manifest: dict, library: str, shown: str) -> None:
    """Refuse an artifact this host cannot run: another architecture, missing ISA extensions, no GPU."""
    from . import _compat as C
    from .target import host_target

    tdesc = manifest["target"]
    here = host_arch()
    lib_arch = elf_machine(library)
    if tdesc.get("arch") != here or lib_arch != here:
        raise ArtifactError(f"{shown}: built for {tdesc.get('arch')} ({tdesc.get('mtriple') or 'no triple'}; "
                            f"library is {lib_arch}), this host is {here}")
    wanted = set(tdesc.get("isa_features", []))
    have = {f for f in C.llvm_cpu_features(host_target()) if _ISA_FEATURE.match(f)}
    missing = sorted(wanted - have)
    if missing:
        raise ArtifactError(f"{shown}: built for CPU {tdesc.get('mcpu') or '?'} using {', '.join(missing)}, "
                            f"which this CPU ({C.llvm_system_cpu()}) lacks; export for this host's target")
    if tdesc.get("kind") == "cuda":
        arch = tdesc.get("cuda_arch", "")
        if not C.runtime_enabled("cuda") or not C.device("cuda", 0).exist:
            raise ArtifactError(f"{shown}: built for CUDA ({arch}) but this host has no usable CUDA GPU "
                                f"(TVM CUDA runtime {'present' if C.runtime_enabled('cuda') else 'absent'})")
        dev_version = tuple(int(x) for x in str(C.device("cuda", 0).compute_version).split("."))
        if dev_version < _cuda_compute_version(arch):
            raise ArtifactError(f"{shown}: built for CUDA {arch}, this GPU is compute capability "
                                f"{'.'.join(map(str, dev_version))}")
    elif tdesc.get("kind") != "llvm":
        raise ArtifactError(f"{shown}: artifacts for target kind {tdesc.get('kind')!r} cannot be loaded here")


# Prebuilt device code by kernel-source sha256, for every loaded artifact of this process.
_DEVICE_CODE: dict[str, bytes] = {}
_CALLBACK_INSTALLED = False


def _prebuilt_cuda_code(code, *_args):
    """TVM's CUDA runtime asks to compile kernel source at load time; answer with the exported binary."""
    key = hashlib.sha256(str(code).encode()).hexdigest()
    if key not in _DEVICE_CODE:
        raise ArtifactError(f"the artifact has no prebuilt device code for kernel source {key[:12]}; "
                            "re-export it (tvmfuse never compiles at load time)")
    return _DEVICE_CODE[key]


def _install_device_code(root: str, manifest: dict) -> None:
    global _CALLBACK_INSTALLED
    from . import _compat as C

    for entry in manifest.get("device_code", []):
        with open(os.path.join(root, entry["file"]), "rb") as f:
            _DEVICE_CODE[entry["source_sha256"]] = f.read()
    if manifest.get("device_code") and not _CALLBACK_INSTALLED:
        C.register_global_func("tvm_callback_cuda_compile", _prebuilt_cuda_code, override=True)
        _CALLBACK_INSTALLED = True


# --------------------------------------------------------------------------- load: the runner
class Runner(Executes):
    """A loaded artifact: ``run(feeds, outputs=None) -> {output name: array}`` and ``bind(feeds)`` (no
    copies, as ``CompiledModel``; see tvmfuse.io), ``inputs``, ``outputs``, ``manifest``."""

    def __init__(self, path: str, num_threads: int | None = None):
        from . import _compat as C
        from .compiled import TensorSpec
        from .target import configure_threads

        t0 = time.perf_counter()
        self.path = os.fspath(path)
        self._tmp = None
        if os.path.isdir(self.path):
            root = self.path
        elif os.path.isfile(self.path) and _is_tar(self.path):
            self._tmp = tempfile.TemporaryDirectory(prefix="tvmfuse-artifact-")
            root = self._tmp.name
            _extract_tar(self.path, root)
        elif not os.path.exists(self.path):
            raise ArtifactError(f"artifact not found: {self.path}")
        else:
            raise ArtifactError(f"{self.path} is neither an artifact directory nor a .tar")
        self.root = root
        self.manifest = _read_manifest(root, self.path)
        _verify_files(root, self.manifest, self.path)
        library = os.path.join(root, self.manifest["library"])
        check_host(self.manifest, library, self.path)
        self.inputs = [TensorSpec(d["name"], tuple(d["shape"]), d["dtype"]) for d in self.manifest["inputs"]]
        self.outputs = [TensorSpec(d["name"], tuple(d["shape"]), d["dtype"]) for d in self.manifest["outputs"]]
        kind = self.manifest["target"]["kind"]
        if kind == "cuda":
            _install_device_code(root, self.manifest)
            self.device = C.device("cuda", 0)
        else:
            configure_threads(num_threads)
            self.device = C.cpu(0)
        # kernels compiled with element_aligned_args read numpy inputs in place; an artifact written before
        # the option existed assumes TVM's 64-byte alignment (its inputs are copied unless aligned so)
        self.shape_upper_bounds = {str(k): int(v) for k, v in (self.manifest.get("shape_upper_bounds") or {}).items()}
        self.element_aligned_args = kind != "cuda" and bool(
            (self.manifest.get("pipeline_options") or {}).get("element_aligned_args", False))
        try:
            self.module = C.load_module(library)
            self._vm = C.VirtualMachine(self.module, self.device)
            self._main_fn = None
        except (RuntimeError, OSError) as e:
            raise ArtifactError(f"{self.path}: the TVM runtime cannot load {self.manifest['library']}: {e}") \
                from None
        self._align_numpy()
        self.load_seconds = time.perf_counter() - t0

    def random_feeds(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Standard-normal floats (integers in [0, 2) for integer inputs), one array per input."""
        rng = np.random.default_rng(seed)
        feeds = {}
        for spec in self.inputs:
            if any(not isinstance(d, int) for d in spec.shape):
                raise InputError(f"input {spec.name!r} has a symbolic shape {list(spec.shape)}; give feeds")
            if np.issubdtype(np.dtype(spec.dtype), np.floating):
                feeds[spec.name] = rng.standard_normal(spec.shape).astype(spec.dtype)
            else:
                feeds[spec.name] = rng.integers(0, 2, size=spec.shape).astype(spec.dtype)
        return feeds

    def _main(self):
        if self._main_fn is None:
            self._main_fn = self._vm["main"]
        return self._main_fn

    def _output_count_error(self, got: int) -> Exception:
        return ArtifactError(f"{self.path}: the library returned {got} outputs, the manifest lists "
                             f"{len(self.outputs)}")

    def __repr__(self) -> str:
        t = self.manifest["target"]
        return (f"Runner({self.path!r}, model={self.manifest.get('model')!r}, target={t['kind']} "
                f"{t.get('mcpu') or t.get('cuda_arch', '')}, inputs={[s.name for s in self.inputs]})")


def load(path: str, num_threads: int | None = None) -> Runner:
    """Check an exported artifact (files, digests, format, host) and load it with the TVM runtime."""
    return Runner(path, num_threads=num_threads)


# --------------------------------------------------------------------------- command line
def cmd_export(args) -> int:
    from .compiled import compile as compile_model, input_shapes_of, shape_bounds_of

    t0 = time.perf_counter()
    cm = compile_model(args.model, target=args.target, tuning_log=args.tuning_log,
                       input_shapes=input_shapes_of(args), shape_upper_bounds=shape_bounds_of(args))
    t1 = time.perf_counter()
    out = export(cm, args.output)
    t2 = time.perf_counter()
    print(cm.report.table())
    tdesc = describe_target(cm.target)
    print(f"compiled in {t1 - t0:.1f} s, exported in {t2 - t1:.1f} s")
    print(f"artifact: {out} ({artifact_size(out) / 1e3:.1f} kB) for {tdesc['kind']} {tdesc['arch']} "
          f"{tdesc.get('cuda_arch') or tdesc['mcpu']}")
    return 0


def add_commands(subparsers) -> None:
    from .compiled import add_compile_options

    e = subparsers.add_parser("export", help="compile an ONNX model and write a deployable artifact")
    add_compile_options(e, shape_bound=True)
    e.add_argument("-o", "--output", required=True, help="artifact directory, or a .tar file")
    e.set_defaults(func=cmd_export)
