"""``cpu.symbolic_matmul``'s default macro tile divides N's register tiles where a choice does.

levit_dyn (corpus): x[batch, 16, 32] @ W[32, 160]; on AVX2 16-column register tiles, 10 of them, and the
default's 8 per macro tile left a column predicate in the parallel row nest that TVM's lowering refused
("mismatched types. int32 vs. int64"), so the model did not compile symbolic (notes/visionsym13.md).
Structural: on named targets the default's nc_tiles divides the column tiles and the kernel lowers;
numeric: the symbolic build against numpy at batch 1, 3, 8.
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func

from conftest import NAMED_TARGETS, named_target

TOKENS, K, N = 16, 32, 160
FAMILY = "cpu.symbolic_matmul"


def _model(batch, seed=0):
    w = (np.random.default_rng(seed).standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "levit_matmul",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, TOKENS, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, TOKENS, N])],
                          [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    return m, w


@pytest.mark.parametrize("tname", sorted(NAMED_TARGETS))
def test_default_macro_tile_divides_the_column_tiles_and_lowers(tname):
    target = named_target(tname)
    mod = tvmfuse.load_onnx(_model("batch")[0])
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    funcs = {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}
    assert len(funcs) == 1
    (kname, func), = funcs.items()
    res = schedule_prim_func(func, target, {}, kname)
    assert res is not None and res.template == FAMILY, (kname, res and res.template)
    configs = [b["config"] for b in res.config["buckets"]] if "buckets" in res.config else [res.config]
    for cfg in (c for c in configs if c["mr"] > 1):       # the row-tiled nests (GEMV-like ones: mr 1)
        tiles = -(-N // (cfg["nvec"] * cfg["lanes"]))
        assert tiles % cfg["nc_tiles"] == 0, (tname, cfg)
    C.lower_tir(C.IRModule({"main": res.func.with_attr("global_symbol", "main")}), target)


def test_symbolic_matmul_with_ten_column_tiles_numbers(host, rng):
    model, w = _model("batch")
    cm = tvmfuse.compile(model, target=host)
    for batch in (1, 3, 8):
        x = rng.standard_normal((batch, TOKENS, K)).astype(np.float32)
        np.testing.assert_allclose(cm.run({"x": x})["y"], x @ w, rtol=1e-4, atol=1e-4, err_msg=f"batch {batch}")
