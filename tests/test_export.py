"""Deployment artifacts: export, load in a fresh process, every refusal on load, cross-compiled artifacts."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import onnx
import pytest

import tvmfuse
from tvmfuse import ArtifactError, InputError
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.cli import main
from tvmfuse.export import FORMAT_VERSION, _isa_features, _manifest_digest, elf_machine, fatbin_archs, host_arch

SMALL = {"transformer_block": dict(seq=16, hidden=32, heads=2, ffn=64),
         "resnet_block": dict(channels=8, size=8)}

# Loads artifacts in a fresh interpreter with no compiler reachable: PATH is empty and TVM's compile entry
# points raise. Prints the modules that loading (not `import tvmfuse`) pulled in.
_LOADER = r"""
import json, sys
import numpy as np
import tvmfuse, tvm
def _no_compile(*a, **k):
    raise AssertionError("a compiler was called at load time")
tvm.compile = tvm.relax.build = tvm.tirx.build = _no_compile
req = json.loads(sys.argv[1])
before = set(sys.modules)
outs = {}
for path in req["artifacts"]:
    r = tvmfuse.load(path)
    with np.load(req["feeds"]) as z:
        out = r.run({k: z[k] for k in z.files})
    np.savez(path.rstrip("/") + ".out.npz", **out)
print(json.dumps({"new_modules": sorted(set(sys.modules) - before),
                  "onnx_loaded": any(m.split(".")[0] == "onnx" for m in sys.modules)}))
"""


def _load_in_fresh_process(artifacts, feeds, tmp_path):
    fpath = str(tmp_path / "feeds.npz")
    np.savez(fpath, **feeds)
    empty = tmp_path / "empty_path"
    empty.mkdir(exist_ok=True)
    r = subprocess.run([sys.executable, "-c", _LOADER, json.dumps({"artifacts": artifacts, "feeds": fpath})],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PATH": str(empty)})
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    outs = []
    for a in artifacts:
        with np.load(a.rstrip("/") + ".out.npz") as z:
            outs.append({k: z[k] for k in z.files})
    return outs, info


@pytest.fixture(scope="module")
def compiled():
    return {name: tvmfuse.compile(M.DEMO_MODELS[name](**SMALL[name]), name=name) for name in SMALL}


@pytest.fixture(scope="module")
def resnet_artifact(compiled, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("art") / "resnet")
    return tvmfuse.export(compiled["resnet_block"], out)


@pytest.fixture
def artifact(resnet_artifact, tmp_path):
    """A private copy of the resnet artifact to damage."""
    return shutil.copytree(resnet_artifact, str(tmp_path / "copy"))


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("name", sorted(SMALL))
def test_demo_model_loads_in_fresh_process_with_equal_outputs(name, compiled, tmp_path):
    cm = compiled[name]
    d = tvmfuse.export(cm, str(tmp_path / name))
    t = tvmfuse.export(cm, str(tmp_path / f"{name}.tar"))
    assert sorted(os.listdir(d)) == ["manifest.json", "model.so"]
    with tarfile.open(t) as tf:
        assert sorted(tf.getnames()) == ["manifest.json", "model.so"]
    feeds = tvmfuse.load(d).random_feeds(seed=3)
    expected = cm.run(feeds)
    (from_dir, from_tar), info = _load_in_fresh_process([d, t], feeds, tmp_path)
    for got in (from_dir, from_tar):
        assert sorted(got) == sorted(expected)
        for k in expected:
            np.testing.assert_array_equal(got[k], expected[k], err_msg=f"{name} output {k}")
    # neither `import tvmfuse` nor loading imports onnx; loading imports no compiler module
    assert info["onnx_loaded"] is False
    assert not [m for m in info["new_modules"] if m.split(".")[0] == "onnx" or m.startswith(
        ("tvm.relax.frontend", "tvm.support.cc", "tvm.support.nvcc"))], info["new_modules"]


def test_manifest_contents(compiled, resnet_artifact):
    cm = compiled["resnet_block"]
    with open(os.path.join(resnet_artifact, "manifest.json")) as f:
        m = json.load(f)
    assert m["format_version"] == FORMAT_VERSION and m["manifest_sha256"] == _manifest_digest(m)
    assert m["inputs"] == [s.to_dict() for s in cm.inputs] == [{"name": "x", "shape": [1, 8, 8, 8],
                                                                 "dtype": "float32"}]
    assert m["outputs"] == [s.to_dict() for s in cm.outputs]
    assert m["target"]["json"]["mcpu"] == str(cm.target.attrs["mcpu"]) and m["target"]["arch"] == host_arch()
    assert tvmfuse.parse_target(m["target"]["json"]).kind.name == "llvm"
    assert m["versions"]["tvmfuse"] == tvmfuse.__version__ and m["versions"]["tvm"].startswith("0.27")
    assert m["report"] == json.loads(cm.report.to_json())
    assert m["tuning_log"] is None
    for rel, info in m["files"].items():
        with open(os.path.join(resnet_artifact, rel), "rb") as f:
            data = f.read()
        assert info == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def test_tuning_log_digest_recorded(tmp_path):
    log = tmp_path / "tune.jsonl"
    log.write_text("")  # an empty log: no records apply, but its digest is still the provenance
    cm = tvmfuse.compile(M.elementwise_chain(n=64), tuning_log=str(log))
    m = tvmfuse.load(tvmfuse.export(cm, str(tmp_path / "a"))).manifest
    assert m["tuning_log"] == {"path": str(log), "sha256": hashlib.sha256(b"").hexdigest(), "bytes": 0}


# --------------------------------------------------------------------------- refusals on load
def _rewrite_manifest(path, change):
    p = os.path.join(path, "manifest.json")
    with open(p) as f:
        m = json.load(f)
    change(m)
    m["manifest_sha256"] = _manifest_digest(m)
    with open(p, "w") as f:
        json.dump(m, f)


def test_missing_artifact_and_missing_file(artifact, tmp_path):
    with pytest.raises(ArtifactError, match="artifact not found"):
        tvmfuse.load(str(tmp_path / "nowhere"))
    os.remove(os.path.join(artifact, "model.so"))
    with pytest.raises(ArtifactError, match="file model.so is missing"):
        tvmfuse.load(artifact)


def test_missing_manifest(artifact):
    os.remove(os.path.join(artifact, "manifest.json"))
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        tvmfuse.load(artifact)


def test_tampered_byte_never_runs(artifact):
    lib = os.path.join(artifact, "model.so")
    with open(lib, "r+b") as f:
        f.seek(os.path.getsize(lib) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        tvmfuse.load(artifact)


def test_truncated_library_and_tar(artifact, tmp_path):
    lib = os.path.join(artifact, "model.so")
    with open(lib, "r+b") as f:
        f.truncate(os.path.getsize(lib) - 100)
    with pytest.raises(ArtifactError, match="truncated"):
        tvmfuse.load(artifact)
    t = str(tmp_path / "a.tar")
    with tarfile.open(t, "w") as tf:
        tf.add(artifact, arcname=".")
    with open(t, "r+b") as f:
        f.truncate(os.path.getsize(t) // 2)
    with pytest.raises(ArtifactError):
        tvmfuse.load(t)


def test_edited_manifest(artifact):
    p = os.path.join(artifact, "manifest.json")
    with open(p) as f:
        m = json.load(f)
    m["inputs"][0]["shape"] = [2, 8, 8, 8]
    with open(p, "w") as f:
        json.dump(m, f)
    with pytest.raises(ArtifactError, match="does not match its recorded digest"):
        tvmfuse.load(artifact)
    with open(p, "w") as f:
        f.write('{"format": "tvmfuse-art')
    with pytest.raises(ArtifactError, match="not valid JSON"):
        tvmfuse.load(artifact)


def test_newer_format_version(artifact):
    _rewrite_manifest(artifact, lambda m: m.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(ArtifactError, match=f"format version {FORMAT_VERSION + 1} is newer"):
        tvmfuse.load(artifact)


def test_cpu_without_the_isa_extensions_is_refused(tmp_path):
    host_isa = set(_isa_features(tvmfuse.host_target()))
    for mcpu in ("skylake-avx512", "sapphirerapids", "graniterapids"):
        tgt = tvmfuse.parse_target({"kind": "llvm", "mcpu": mcpu, "mtriple": f"{host_arch()}-unknown-linux-gnu"})
        missing = set(_isa_features(tgt)) - host_isa
        if missing:
            break
    else:
        pytest.skip("this CPU has every ISA extension of the CPUs tried (skylake-avx512 .. graniterapids)")
    cm = tvmfuse.compile(M.elementwise_chain(n=256), target=tgt)
    out = tvmfuse.export(cm, str(tmp_path / "foreign"))
    with pytest.raises(ArtifactError, match=f"built for CPU {mcpu} using .*{sorted(missing)[0]}"):
        tvmfuse.load(out)


def test_wrong_feeds(resnet_artifact):
    r = tvmfuse.load(resnet_artifact)
    x = r.random_feeds()["x"]
    with pytest.raises(InputError, match="unknown input name"):
        r.run({"y": x})
    with pytest.raises(InputError, match="missing input"):
        r.run({})
    with pytest.raises(InputError, match=r"shape \[1, 8, 8, 4\]"):
        r.run({"x": x[..., :4]})
    with pytest.raises(InputError, match="dtype float64"):
        r.run({"x": x.astype(np.float64)})


def test_cli_refuses_tampered_artifact_with_one_line(artifact, capsys):
    with open(os.path.join(artifact, "model.so"), "ab") as f:
        f.write(b"\0")
    assert main(["run", artifact]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tvmfuse: error:") and "model.so" in err and "\n" not in err


# --------------------------------------------------------------------------- cross targets
def test_aarch64_artifact_is_an_arm64_elf(tmp_path):
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        pytest.skip("aarch64-linux-gnu-gcc not installed (the cross linker; .ci/run installs the Debian/Ubuntu "
                    "package gcc-aarch64-linux-gnu)")
    cm = tvmfuse.compile(M.resnet_block(**SMALL["resnet_block"]), target="aarch64")
    out = tvmfuse.export(cm, str(tmp_path / "arm.tar"))
    with tarfile.open(out) as tf:
        tf.extractall(tmp_path / "x", filter="data")
    assert elf_machine(str(tmp_path / "x" / "model.so")) == "aarch64"
    m = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert m["target"]["arch"] == "aarch64" and m["library_arch"] == "aarch64"
    assert "neon" in m["target"]["isa_features"]
    if host_arch() != "aarch64":
        with pytest.raises(ArtifactError, match=f"built for aarch64 .* this host is {host_arch()}"):
            tvmfuse.load(out)


def test_cuda_artifact_holds_sm90_code(tmp_path, compiled):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: CUDA device code cannot be built")
    model = M.resnet_block(**SMALL["resnet_block"])
    cm = tvmfuse.compile(model, target={"kind": "cuda", "arch": "sm_90"})
    out = tvmfuse.export(cm, str(tmp_path / "gpu"))
    m = json.loads(open(os.path.join(out, "manifest.json")).read())
    assert m["target"]["kind"] == "cuda" and m["target"]["cuda_arch"] == "sm_90"
    assert elf_machine(os.path.join(out, "model.so")) == host_arch()  # the host side
    (dev,) = m["device_code"]
    fatbin = open(os.path.join(out, dev["file"]), "rb").read()
    assert ("sass", 90) in fatbin_archs(fatbin), fatbin_archs(fatbin)
    cubin = fatbin[fatbin.index(b"\x7fELF"):]
    assert int.from_bytes(cubin[18:20], "little") == 190  # EM_CUDA
    # the runtime asks for the kernel source stored in the library; its digest keys the prebuilt code
    lib = open(os.path.join(out, "model.so"), "rb").read()
    src = cm.executable.mod.imports[0].imports[0].inspect_source("")
    assert hashlib.sha256(src.encode()).hexdigest() == dev["source_sha256"] and src.encode() in lib
    if C.device("cuda", 0).exist:
        feeds = M.random_feeds(model)
        got = tvmfuse.load(out).run(feeds)
        np.testing.assert_allclose(got["y"], compiled["resnet_block"].run(feeds)["y"], rtol=1e-4, atol=1e-4)
    else:
        with pytest.raises(ArtifactError, match=r"built for CUDA \(sm_90\) but this host has no usable CUDA GPU"):
            tvmfuse.load(out)


# --------------------------------------------------------------------------- command line
def test_cli_export_and_run(tmp_path, capsys):
    model = M.resnet_block(**SMALL["resnet_block"])
    mpath = str(tmp_path / "m.onnx")
    onnx.save(model, mpath)
    assert main(["export", mpath, "-o", str(tmp_path / "a.tar")]) == 0
    out = capsys.readouterr().out
    assert "artifact:" in out and "a.tar" in out and "kB" in out
    assert main(["compile", mpath, "-o", str(tmp_path / "b")]) == 0
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 8, 8, 8)).astype(np.float32)}
    np.savez(tmp_path / "x.npz", **feeds)
    for art in ("a.tar", "b"):
        assert main(["run", str(tmp_path / art), "--inputs", str(tmp_path / "x.npz"),
                     "-o", str(tmp_path / f"{art}.y.npz")]) == 0
        with np.load(tmp_path / f"{art}.y.npz") as z:
            np.testing.assert_allclose(z["y"], M.reference_outputs(model, feeds)["y"], rtol=1e-4, atol=1e-5)
