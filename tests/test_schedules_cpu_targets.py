"""Schedule defaults come from the target, never from the machine running the compiler.

The table schedules/cpu_targets.json (per-CPU vector width, caches; generic rows per vector width; template
defaults) agrees with LLVM's view of each CPU; ``cpu_info`` derives everything from the target (mcpu, mattr,
num-cores) and the table; the same target gives identical CPUInfo and identical scheduled TIR whatever the
host says about itself (the host-reading functions patched to fail or to lie); only ``host_target()``
reads the host, and it puts what it reads into the target.
"""
import builtins
import json
import os
import tomllib

import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse import target as TG
from tvmfuse.errors import TargetError
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func

from conftest import NAMED_TARGETS, named_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRIPLES = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}


def _target(mcpu, arch="x86_64", **attrs):
    return tvmfuse.parse_target({"kind": "llvm", "mtriple": TRIPLES[arch], "mcpu": mcpu, **attrs})


def _fresh_info(target):
    TG._CPU_INFO.clear()
    return TG.cpu_info(target)


# --------------------------------------------------------------------------- the table
def test_table_rows_agree_with_llvm():
    """Every CPU row is an mcpu LLVM knows for its architecture, with the vector width LLVM's features of
    that mcpu give (the width cpu_info uses), and positive cache sizes."""
    table = TG.cpu_table()
    assert set(table["generic_by_vector_bits"]) == {"128", "256", "512"}
    for name, row in table["cpus"].items():
        feats = C.llvm_cpu_features(_target(name, row["arch"]))
        assert TG._vector_bits(feats) == row["vector_bits"], (name, sorted(feats)[:12])
        info = _fresh_info(_target(name, row["arch"], **{"num-cores": 3}))
        assert info.table_entry == name and info.mcpu == name
        assert (info.l1d_bytes, info.l2_bytes) == (row["l1d_kib"] * 1024, row["l2_kib"] * 1024)
        assert info.cores == 3 and info.has_fma, name
        for alias in row.get("aliases", ()):
            assert _fresh_info(_target(alias, row["arch"])).table_entry == name


def test_generic_fallback_per_vector_width_and_features_from_mattr():
    table = TG.cpu_table()
    # an mcpu the table does not list: the generic row of LLVM's vector width for it
    info = _fresh_info(_target("x86-64-v2"))
    assert (info.vector_bits, info.table_entry) == (128, "generic_by_vector_bits.128")
    assert info.l2_bytes == table["generic_by_vector_bits"]["128"]["l2_kib"] * 1024
    assert _fresh_info(_target("tigerlake")).table_entry == "generic_by_vector_bits.512"
    assert _fresh_info(tvmfuse.parse_target({"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                                             "mattr": ["+neon"]})).table_entry == "generic_by_vector_bits.128"
    # -mattr=-avx512f on an AVX-512 CPU: 256-bit vectors, that CPU's caches
    info = _fresh_info(_target("skylake-avx512", mattr=["-avx512f"]))
    assert (info.vector_bits, info.table_entry) == (256, "skylake-avx512")
    # no FMA on a plain x86-64; NEON always has it
    assert not _fresh_info(_target("x86-64")).has_fma
    assert _fresh_info(_target("neoverse-n1", "aarch64")).has_fma


def test_no_num_cores_gets_the_documented_default_not_the_host(monkeypatch):
    monkeypatch.setattr(TG, "physical_cores", lambda: 96)
    monkeypatch.setattr(os, "cpu_count", lambda: 192)
    info = _fresh_info(_target("haswell"))
    assert info.cores == TG.cpu_table()["default_num_cores"] == TG.default_num_cores()


def test_host_target_carries_the_host_into_the_target(monkeypatch):
    """host_target() reads the host's CPU and cores, as target attributes: cpu_info then gives the host's
    facts through the target (the table row of its CPU)."""
    monkeypatch.setattr(C, "llvm_system_cpu", lambda: "znver3")
    monkeypatch.setattr(TG, "physical_cores", lambda: 7)
    t = tvmfuse.host_target()
    assert t.attrs["mcpu"] == "znver3" and int(t.attrs["num-cores"]) == 7
    info = _fresh_info(t)
    assert (info.vector_bits, info.cores, info.l2_bytes, info.table_entry) == (256, 7, 512 * 1024, "znver3")


def test_template_defaults_from_the_table_and_per_cpu_override(monkeypatch):
    table = json.loads(json.dumps(TG.cpu_table()))
    assert TG.template_defaults(_target("haswell"), "cpu.elementwise") == \
        table["template_defaults"]["cpu.elementwise"]
    table["cpus"]["znver4"]["template_defaults"] = {"cpu.elementwise": {"unroll": 7}}
    monkeypatch.setattr(TG, "cpu_table", lambda: table)
    got = TG.template_defaults(_target("znver4"), "cpu.elementwise")
    assert got == {**table["template_defaults"]["cpu.elementwise"], "unroll": 7}
    assert TG.template_defaults(_target("znver3"), "cpu.elementwise")["unroll"] == \
        table["template_defaults"]["cpu.elementwise"]["unroll"]
    with pytest.raises(TargetError, match="no template_defaults for 'cpu.nope'"):
        TG.template_defaults(_target("znver3"), "cpu.nope")


def test_bad_or_missing_table_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(TG, "data_dirs", lambda name: [tmp_path])
    TG.cpu_table.cache_clear()
    try:
        with pytest.raises(TargetError, match="cpu_targets.json is not installed"):
            TG.cpu_table()
        with open(os.path.join(ROOT, "schedules", "cpu_targets.json")) as f:
            good = json.load(f)
        del good["cpus"]["haswell"]["l2_kib"]
        (tmp_path / "cpu_targets.json").write_text(json.dumps(good))
        with pytest.raises(TargetError, match=r"cpus.haswell needs positive integer field\(s\) \['l2_kib'\]"):
            TG.cpu_table()
        del good["template_defaults"]
        (tmp_path / "cpu_targets.json").write_text(json.dumps(good))
        with pytest.raises(TargetError, match=r"missing field\(s\) \['template_defaults'\]"):
            TG.cpu_table()
    finally:
        TG.cpu_table.cache_clear()
        TG._CPU_INFO.clear()


def test_table_ships_like_the_tuning_logs():
    """pyproject installs schedules/*.json next to the tuning logs (share/tvmfuse/<folder>), where
    data_dirs() looks; a source checkout finds the top-level folder."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        files = tomllib.load(f)["tool"]["setuptools"]["data-files"]
    assert files["share/tvmfuse/schedules"] == ["schedules/*.json"]
    assert files["share/tvmfuse/tuning_logs"] == ["tuning_logs/*.jsonl"]
    assert os.path.realpath(TG.data_dirs("schedules")[0]) == os.path.join(os.path.realpath(ROOT), "schedules")


def test_target_strings_in_the_former_cli_form():
    t = tvmfuse.parse_target("llvm -mtriple=x86_64-linux-gnu -mcpu=skylake-avx512 -num-cores=32 -mattr=+avx2,+fma")
    assert (t.attrs["mcpu"], int(t.attrs["num-cores"]), list(t.attrs["mattr"])) == \
        ("skylake-avx512", 32, ["+avx2", "+fma"])
    with pytest.raises(TargetError, match="not of the form -key=value"):
        tvmfuse.parse_target("llvm -mcpu")


# --------------------------------------------------------------------------- host independence
KERNELS = [("softmax", dict(rows=23, d=104, decomposed=False)), ("elementwise_chain", dict(n=4099)),
           ("matmul_bias_gelu", dict(m=37, k=45, n=67)), ("swiglu", dict(seq=29, hidden=768, ffn=50)),
           ("layernorm", dict(rows=37, d=101))]


def _scheduled(target):
    out = {}
    for builder, kwargs in KERNELS:
        mod = tvmfuse.load_onnx(getattr(M, builder)(**kwargs))
        with target:
            mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
        for gv, func in mod.functions.items():
            if isinstance(func, C.PrimFunc):
                res = schedule_prim_func(func, target, {}, str(gv.name_hint))
                assert res is not None, gv.name_hint
                out[f"{builder}/{gv.name_hint}"] = (res.template, res.config, res.func)
    return out


def _host_lies(monkeypatch, mode):
    """Make every host-reading function fail ("fail") or describe another machine ("other")."""
    import psutil

    def fail(*_a, **_k):
        raise AssertionError("a schedule default read the host")

    lie = {"fail": (fail, fail, fail), "other": (lambda: 64, lambda: "znver3", lambda *a, **k: 128)}[mode]
    monkeypatch.setattr(TG, "physical_cores", lie[0])
    monkeypatch.setattr(C, "llvm_system_cpu", lie[1])
    monkeypatch.setattr(C, "llvm_system_triple", lie[1])
    monkeypatch.setattr(os, "cpu_count", lie[2])
    monkeypatch.setattr(psutil, "cpu_count", lie[2])
    # the host's cache sizes and CPU description: /sys/devices/system/cpu, /proc/cpuinfo
    real_open, real_listdir = builtins.open, os.listdir

    def guarded(real):
        def call(path, *a, **k):
            if str(path).startswith(("/sys/devices/system/cpu", "/proc/cpuinfo")):
                fail()
            return real(path, *a, **k)
        return call

    monkeypatch.setattr(builtins, "open", guarded(real_open))
    monkeypatch.setattr(os, "listdir", guarded(real_listdir))


@pytest.mark.parametrize("tname", list(NAMED_TARGETS))
def test_same_target_same_kernels_on_any_host(tname, monkeypatch):
    """The same named target gives identical CPUInfo and structurally identical scheduled TIR (same
    templates and knobs) when the host-reading functions fail, and when they describe another machine."""
    target = named_target(tname)
    want_info = _fresh_info(target)
    want = _scheduled(target)
    for mode in ("fail", "other"):
        with monkeypatch.context() as m:
            _host_lies(m, mode)
            assert _fresh_info(target) == want_info, mode
            got = _scheduled(target)
        assert got.keys() == want.keys()
        for k, (family, config, func) in got.items():
            assert (family, config) == want[k][:2], (mode, k)
            C.assert_structural_equal(func, want[k][2])
    TG._CPU_INFO.clear()
