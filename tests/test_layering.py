"""The architecture, checked from the source with ``ast`` (no import runs): the layers of ARCHITECTURE.md.

- only ``tvmfuse/_compat.py`` imports TVM (``tvm``, ``tvm_ffi``), in the package, the tests and the benchmarks;
- ``_compat`` defines each name once and every name it exports is used somewhere;
- a tvmfuse module imports only from its own part or from a lower layer (plus the one same-layer arrow
  the table allows: passes -> schedules), so there is no import cycle between parts;
- no tvmfuse module imports another module's private (``_underscore``) name.
"""
from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "tvmfuse"
COMPAT = PKG / "_compat.py"

# part -> (layer, modules or packages, relative to tvmfuse/).  Higher layers use lower ones, nothing reaches up.
PARTS = {
    "face": (6, ["__init__", "__main__", "cli", "demo", "explain_cli", "conformance"]),
    "deploy": (5, ["export"]),
    "tune": (5, ["tune"]),
    "compiled": (4, ["compiled"]),
    "stages": (3, ["pipeline"]),
    "passes": (2, ["passes"]),
    "schedules": (2, ["schedules", "fastmath"]),
    "analysis": (1, ["analysis"]),
    "records": (1, ["records"]),
    "front": (1, ["frontend", "models", "feeds"]),
    "runtime_io": (1, ["io", "runtime_native"]),
    "floor": (0, ["_compat", "target", "errors", "report", "explain", "version"]),
}
# arrows between different parts of one layer that the table allows (the schedules' accepts(group, target))
SAME_LAYER = {("passes", "schedules")}
TVM_ROOTS = {"tvm", "tvm_ffi"}


def _py_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    """The file's syntax tree, parsed once per test session."""
    return ast.parse(path.read_text(), filename=str(path))


def _imports(path: Path):
    """(line, imported module, imported name or None) of every import in the file (also inside functions)."""
    tree = _tree(path)
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                # ``from pkg import submodule`` imports the submodule; ``from mod import name``, a name of mod
                yield (node.lineno, sub, None) if _is_module(sub) else (node.lineno, mod, a.name)


def _part_of(module: str) -> str | None:
    """The part a tvmfuse module belongs to (longest listed prefix), None for a module the table lacks."""
    rel = module.split(".")[1:] or ["__init__"]
    best, best_len = None, 0
    for part, (_, prefixes) in PARTS.items():
        for prefix in prefixes:
            p = prefix.split(".")
            if rel[:len(p)] == p and len(p) > best_len:
                best, best_len = part, len(p)
    return best


# runs on a GPU machine that has TVM's runtime library only, where tvmfuse (hence _compat) cannot be imported
RUNTIME_ONLY_SCRIPTS = {ROOT / "benchmarks" / "gpu_run.py"}


def test_only_compat_imports_tvm():
    bad = [f"{p.relative_to(ROOT)}:{line}: imports {mod}"
           for p in _py_files("tvmfuse", "tests", "benchmarks") if p != COMPAT and p not in RUNTIME_ONLY_SCRIPTS
           for line, mod, _ in _imports(p) if mod.split(".")[0] in TVM_ROOTS]
    assert not bad, "import TVM through tvmfuse._compat (add the name there):\n" + "\n".join(bad)


def _compat_names() -> list[str]:
    names = []
    for node in ast.parse(COMPAT.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", "") != "__future__":
            names += [(a.asname or a.name).split(".")[0] for a in node.names]
    return names


def test_compat_defines_each_name_once():
    names = _compat_names()
    dups = sorted({n for n in names if names.count(n) > 1})
    assert not dups, f"tvmfuse/_compat.py defines these names more than once: {dups}"


def _compat_uses() -> set[str]:
    """Names read as ``<alias of _compat>.NAME`` or imported ``from tvmfuse._compat import NAME`` anywhere."""
    used = set()
    for p in _py_files("tvmfuse", "tests", "benchmarks"):
        tree = _tree(p)
        aliases = {"_compat"}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name == "_compat":
                        aliases.add(a.asname or a.name)
                    elif (node.module or "").endswith("_compat"):
                        used.add(a.name)
        if p == COMPAT:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                used.add(node.attr)
    return used


def test_compat_exports_only_used_names():
    public = [n for n in _compat_names() if not n.startswith("_") and n != "annotations"]
    unused = sorted(set(public) - _compat_uses())
    assert not unused, f"tvmfuse/_compat.py exports names nothing uses (remove them): {unused}"


def _tvmfuse_imports():
    for p in _py_files("tvmfuse"):
        me = _module_name(p)
        for line, mod, name in _imports(p):
            if mod == "tvmfuse" or mod.startswith("tvmfuse."):
                yield p, line, me, mod, name


def test_every_module_has_a_layer():
    missing = sorted({_module_name(p) for p in _py_files("tvmfuse") if _part_of(_module_name(p)) is None})
    assert not missing, f"modules without a part in PARTS (add them, and to ARCHITECTURE.md): {missing}"


def test_no_arrow_reaches_up():
    bad = []
    for p, line, me, mod, _ in _tvmfuse_imports():
        src, dst = _part_of(me), _part_of(mod)
        if src is None or dst is None or src == dst:
            continue
        ls, ld = PARTS[src][0], PARTS[dst][0]
        if ld > ls or (ld == ls and (src, dst) not in SAME_LAYER):
            bad.append(f"{p.relative_to(ROOT)}:{line}: {src} (layer {ls}) imports {mod} ({dst}, layer {ld})")
    assert not bad, "imports against the layers of ARCHITECTURE.md:\n" + "\n".join(bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_compat"


def test_no_private_names_of_other_modules():
    bad = []
    for p, line, me, mod, name in _tvmfuse_imports():
        parts = mod.split(".")
        if name is not None and _private(name):
            bad.append(f"{p.relative_to(ROOT)}:{line}: imports {name} from {mod}")
        # a private helper module (schedules/cuda/_common.py) serves its own package only
        for i, part in enumerate(parts):
            if _private(part) and not me.startswith(".".join(parts[:i]) + "."):
                bad.append(f"{p.relative_to(ROOT)}:{line}: imports the private module {mod}")
    assert not bad, "private names imported from other modules (make them public or move them):\n" + \
        "\n".join(bad)


@pytest.mark.parametrize("src,dst,allowed", [
    ("tvmfuse.schedules", "tvmfuse.tune.log", False),       # templates read records through tvmfuse.records
    ("tvmfuse.compiled", "tvmfuse.export", False),          # compile knows no artifact format
    ("tvmfuse.tune.cli", "tvmfuse.cli", False),             # the tuner knows no CLI helpers
    ("tvmfuse.frontend", "tvmfuse.passes", False),
    ("tvmfuse.report", "tvmfuse.pipeline", False),          # the floor uses nothing above it
    ("tvmfuse.schedules.cpu.matmul", "tvmfuse.passes.rules", False),
    ("tvmfuse.passes.rules", "tvmfuse.schedules", True),
    ("tvmfuse.export", "tvmfuse.compiled", True),
    ("tvmfuse.schedules", "tvmfuse.records", True),
])
def test_layer_table_forbids_the_named_arrows(src, dst, allowed):
    """The table itself says no to every arrow the architecture issue names (and yes to the kept ones)."""
    s, d = _part_of(src), _part_of(dst)
    ls, ld = PARTS[s][0], PARTS[d][0]
    ok = s == d or ld < ls or (ld == ls and (s, d) in SAME_LAYER)
    assert ok == allowed, (src, dst)


# --------------------------------------------------------------------------- brief rules checked from the source
PASS_DECORATORS = {"module_pass", "function_pass", "prim_func_pass", "dataflowblock_pass"}
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _calls(path: Path):
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Call):
            f = node.func
            yield node, f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def test_every_pass_is_named():
    """Every ``module_pass`` / ``function_pass`` (through ``_compat``) gives ``name=``: a pass shows up by
    name in TVM's pass instrumentation and in the CLI's report (STYLE.md practice 8)."""
    bad = [f"{p.relative_to(ROOT)}:{node.lineno}: {name}(...) without name="
           for p in _py_files("tvmfuse", "tests", "benchmarks") if p != COMPAT
           for node, name in _calls(p)
           if name in PASS_DECORATORS and not any(k.arg == "name" for k in node.keywords)]
    assert not bad, "unnamed passes:\n" + "\n".join(bad)


def test_no_pickle_anywhere():
    """Logs, artifacts, worker messages and feeds are JSON / .npz: nothing imports a pickle module or
    loads an array with ``allow_pickle=True``."""
    bad = [f"{p.relative_to(ROOT)}:{line}: imports {mod}"
           for p in _py_files("tvmfuse", "tests", "benchmarks")
           for line, mod, _ in _imports(p) if mod.split(".")[0] in PICKLE_MODULES]
    bad += [f"{p.relative_to(ROOT)}:{node.lineno}: {name}(allow_pickle=True)"
            for p in _py_files("tvmfuse", "tests", "benchmarks")
            for node, name in _calls(p)
            if any(k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                   for k in node.keywords)]
    assert not bad, "pickle is not allowed (use JSON or .npz):\n" + "\n".join(bad)


def test_source_rules_catch_what_they_forbid(tmp_path, monkeypatch):
    """The two checks above fail on a file that breaks them (they are not vacuous)."""
    bad = tmp_path / "tvmfuse"
    bad.mkdir()
    (bad / "bad.py").write_text("import pickle\nimport numpy as np\nnp.load('x', allow_pickle=True)\n"
                                "@C.module_pass(opt_level=0)\ndef f(mod, ctx):\n    return mod\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    for test, want in ((test_every_pass_is_named, "module_pass(...) without name="),
                       (test_no_pickle_anywhere, "imports pickle")):
        with pytest.raises(AssertionError, match=re.escape(want)):
            test()
    with pytest.raises(AssertionError, match=r"load\(allow_pickle=True\)"):
        test_no_pickle_anywhere()
