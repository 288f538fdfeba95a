"""``tvmfuse explain MODEL.onnx [--json]`` as a user runs it (a fresh ``python -m tvmfuse`` process): the groups
formed, each refused pair with its reason, and one ``tvmfuse: error:`` line for bad input."""
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

import tvmfuse
from tvmfuse import models as M

AX = np.array([-1], np.int64)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tvmfuse", "explain", *args], capture_output=True, text=True,
                          timeout=300)


def _save(tmp_path, model, name):
    p = tmp_path / f"{name}.onnx"
    onnx.save(model, p)
    return str(p)


def _explain_json(path):
    r = _cli(path, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _cycle_model():
    # a = relu(x); m = a @ W; y = a + m: relu and add cannot share a kernel (the matmul sits between them)
    g = M._G("cycle")
    x = g.input("x", (8, 8))
    a = g.op("Relu", x)
    g.op("Add", a, g.op("MatMul", a, g.weight((8, 8))))
    g.rename_last("y", (8, 8))
    return g.model()


def test_lists_groups_and_every_refusal_with_its_reason(tmp_path):
    path = _save(tmp_path, M.matmul_bias_gelu(m=8, k=16, n=24), "mlp")
    r = _cli(path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"tvmfuse explain: mlp.onnx  [{json.loads(_cli(path, '--json').stdout)['target']}]"
    assert "kernels: 7 unfused (one per op) -> 1 with tvmfuse's groups" in lines
    i = lines.index("groups formed (1):")
    group = lines[i + 1]
    assert group.startswith("  fused_matmul_add") and "matmul + add + multiply + erf" in group
    assert "[contraction_epilogue" in group
    assert "refused fusions (0):" in lines and lines[-1] == "  (none)"
    # the JSON holds the same facts, and the kernel count is what tvmfuse.compile builds
    d = _explain_json(path)
    assert d["model"] == path and d["refused"] == []
    assert [(g["kernel"], g["outputs"]) for g in d["groups"]] == [(group.split(":")[0].strip(), 1)]
    # x / sqrt(2) became x * (1 / sqrt(2)) (peephole) before grouping
    assert d["groups"][0]["ops"] == ["matmul", "add", "multiply", "erf", "add", "multiply", "multiply"]
    assert d["kernels_fused"] == tvmfuse.compile(M.matmul_bias_gelu(m=8, k=16, n=24)).kernel_count == 1


def test_cycle_through_an_outside_consumer_is_refused_with_its_reason(tmp_path):
    path = _save(tmp_path, _cycle_model(), "cycle")
    r = _cli(path)
    assert r.returncode == 0, r.stderr
    # the text names the pair, the rule that considered it and the op that would close the cycle
    refusal = [ln for ln in r.stdout.splitlines() if "[elementwise_chain]" in ln]
    assert len(refusal) == 1, r.stdout
    assert refusal[0].startswith("  relu(") and " -> add(" in refusal[0]
    assert "illegal: the path through matmul(" in refusal[0] and "leaves the group and comes back" in refusal[0]
    assert "fused_matmul_add: matmul + add  [contraction_epilogue]" in r.stdout
    # relu before the matmul: no rule fuses a producer into a contraction, and the output says why
    assert "[no rule]: no rule fuses a producer of kind elemwise into a consumer of kind contraction" in r.stdout
    d = _explain_json(path)
    cyc = [x for x in d["refused"] if x["rule"] == "elementwise_chain"]
    assert len(cyc) == 1 and "leaves the group and comes back" in cyc[0]["reason"]
    assert (d["kernels_unfused"], d["kernels_fused"]) == (3, 2)


def test_symbolic_shape_ops_are_grouped(tmp_path):
    # symbolic extents no longer make an op opaque (issue 13): the chain is one group, nothing refused
    g = M._G("dyn")
    x = g.input("x", ("n", 8))
    g.op("Sigmoid", g.op("Relu", x))
    g.rename_last("y", ("n", 8))
    d = _explain_json(_save(tmp_path, g.model(), "dyn"))
    assert (d["kernels_unfused"], d["kernels_fused"]) == (2, 1) and d["refused"] == []
    assert [grp["rule"] for grp in d["groups"]] == ["elementwise_chain"]
    r = _cli(_save(tmp_path, g.model(), "dyn"))
    assert "groups formed (1):" in r.stdout and "refused fusions (0):\n  (none)" in r.stdout


def test_unprofitable_pair_is_refused_with_its_reason(tmp_path):
    # mean(x @ W + b): the row reduction cannot live in the tiled matmul kernel
    g = M._G("mm_mean")
    x = g.input("x", (8, 16))
    g.op("ReduceMean", M._matmul_bias(g, x, 16, 8), g.const(AX), keepdims=1)
    g.rename_last("y", (8, 1))
    d = _explain_json(_save(tmp_path, g.model(), "mm_mean"))
    r = [x for x in d["refused"] if x["rule"] == "reduction_prologue"]
    assert r and r[0]["reason"].startswith("not profitable: a row reduction")
    assert r[0]["consumer"].startswith("mean(")


def test_missing_file_is_one_error_line_and_exit_2(tmp_path):
    missing = str(tmp_path / "nope.onnx")
    for args in ((missing,), (missing, "--json")):
        r = _cli(*args)
        assert r.returncode == 2
        assert r.stdout == ""
        assert r.stderr.splitlines() == [f"tvmfuse: error: model file not found: {missing}"]


def test_malformed_file_is_one_error_line_and_exit_2(tmp_path):
    bad = tmp_path / "garbage.onnx"
    bad.write_bytes(b"\x08\x07not a protobuf at all\xff\xff")
    r = _cli(str(bad))
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tvmfuse: error: ") and "garbage.onnx" in lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [(), ("a.onnx", "--bogus")])
def test_usage_errors_exit_2(args):
    r = _cli(*args)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1].startswith(("tvmfuse: error: ", "tvmfuse explain: error: "))


def test_cuda_groups_name_the_template_that_accepted_them(tmp_path):
    """On CUDA every group was accepted by a template family, which explain prints after the rule."""
    path = _save(tmp_path, M.matmul_bias_gelu(m=8, k=16, n=24), "mlp")
    r = _cli(path, "--target", '{"kind": "cuda", "arch": "sm_90"}')
    assert r.returncode == 0, r.stderr
    group = [ln for ln in r.stdout.splitlines() if ln.startswith("  fused_matmul_add")]
    assert len(group) == 1 and group[0].endswith("] -> cuda_matmul"), r.stdout
    d = _explain_json_args(path, "--target", '{"kind": "cuda", "arch": "sm_90"}')
    assert [g["template"] for g in d["groups"]] == ["cuda_matmul"]
    # on the host CPU the matmul group is accepted by the CPU matmul family
    assert [g.get("template") for g in _explain_json(path)["groups"]] == ["cpu.matmul_epilogue"]


def _explain_json_args(path, *args):
    r = _cli(path, "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


HASWELL = '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell", "num-cores": 2}'


def _channel_layernorm():
    """A LayerNorm over the channels of NCHW [1, 8, 5, 7]: means over axis 1, not the innermost."""
    g = M._G("chln")
    x = g.input("x", (1, 8, 5, 7))
    ax = g.const(np.array([1], np.int64))
    d = g.op("Sub", x, g.op("ReduceMean", x, ax, keepdims=1))
    var = g.op("ReduceMean", g.op("Mul", d, d), ax, keepdims=1)
    g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.const(np.array(1e-5, np.float32)))))
    g.rename_last("y", (1, 8, 5, 7))
    return g.model()


@pytest.mark.parametrize("model,family", [
    (lambda: M.layernorm(rows=8, d=40), "cpu.row_reduction"),
    (lambda: M.elementwise_chain(n=256), "cpu.elementwise"),
    (lambda: M.norm_matmul(norm="rmsnorm", rows=8, d=40, n=24), "cpu.norm_matmul"),
])
def test_cpu_groups_name_the_family_that_accepted_them(tmp_path, model, family):
    """The CPU row-reduction, elementwise and norm + matmul families accept their rules' groups at graph
    level; explain prints the family after the rule."""
    path = _save(tmp_path, model(), "m")
    r = _cli(path, "--target", HASWELL)
    assert r.returncode == 0, r.stderr
    groups = [ln for ln in r.stdout.splitlines() if ln.startswith("  fused_")]
    assert len(groups) == 1 and groups[0].endswith(f"] -> {family}"), r.stdout
    d = _explain_json_args(path, "--target", HASWELL)
    assert [g.get("template") for g in d["groups"]] == [family]


def test_cpu_family_that_declined_a_group_is_named_with_its_reason(tmp_path):
    """A LayerNorm over the channels of NCHW: cpu.row_reduction declines the group (its means do not reduce the
    innermost axes); the generic schedule takes it, so the fusion stands, and explain says which families
    declined and why."""
    path = _save(tmp_path, _channel_layernorm(), "chln")
    r = _cli(path, "--target", HASWELL)
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("  fused_")]
    assert " -> no family accepted it (cpu.row_reduction: mean(" in line, line
    assert "reduces axes [1] of [1, 8, 5, 7], not the innermost ones" in line, line
    d = _explain_json_args(path, "--target", HASWELL)
    (g,) = d["groups"]
    assert "template" not in g and g["declined"].startswith("cpu.row_reduction: mean(") and d["refused"] == []
