"""Pinning input shapes at import (``tvmfuse.compile(..., input_shapes=...)``, ``--shape`` on the CLI):
by input name or by symbolic dim, checked against the model, then folded like a static export."""
import json

import numpy as np
import onnx
import pytest

import tvmfuse
from tvmfuse import models as M
from tvmfuse.cli import main
from tvmfuse.errors import InputError
from tvmfuse.frontend import fold_static_shapes, parse_shape_args, specialize_inputs, symbolic_dims

from test_symbolic import _mlp   # MatMul + Add + Relu on x: [batch, 64] (the example)


def _two_inputs():
    """x: [batch, seq, 16], m: [batch, seq]: two inputs sharing both symbolic dims; y = x * m[..., None]."""
    g = M._G("two_inputs")
    x = g.input("x", ("batch", "seq", 16))
    m = g.input("m", ("batch", "seq"))
    g.op("Mul", x, g.op("Unsqueeze", m, g.const(np.array([-1], np.int64))))
    g.rename_last("y", ("batch", "seq", 16))
    return g.model()


def _reshape_by_shape_chain():
    """The PyTorch pattern: Shape -> Gather -> Concat -> Reshape of x: [batch, 8, 4] to [batch, 32]."""
    g = M._G("shape_chain")
    x = g.input("x", ("batch", 8, 4))
    s = g.op("Shape", x)
    b = g.op("Unsqueeze", g.op("Gather", s, g.const(np.array(0, np.int64)), axis=0), g.const(np.array([0])))
    target = g.op("Concat", b, g.const(np.array([32], np.int64)), axis=0)
    g.op("Relu", g.op("Reshape", x, target))
    g.rename_last("y", ("batch", 32))
    return g.model()


def _feeds(rng, shapes):
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


# ----------------------------------------------------------------------------------- specialization
@pytest.mark.parametrize("pins", [{"x": [3, 64]}, {"batch": 3}, {"batch": [3]}])
def test_pinned_shape_compiles_static_and_matches_reference(pins, host, rng):
    model = _mlp()
    cm = tvmfuse.compile(model, target=host, input_shapes=pins)
    assert cm.inputs[0].shape == (3, 64) and cm.outputs[0].shape == (3, 32)
    assert cm.kernel_count == 1
    feeds = _feeds(rng, {"x": (3, 64)})
    np.testing.assert_allclose(cm.run(feeds)["y"], M.reference_outputs(model, feeds)["y"], rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match=r"'x' has shape \[4, 64\]"):
        cm.run(_feeds(rng, {"x": (4, 64)}))


def test_pin_by_dim_name_reaches_every_input_that_uses_it(host, rng):
    model = _two_inputs()
    spec = specialize_inputs(model, {"batch": 2, "seq": 5})
    dims = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in spec.graph.input}
    assert dims == {"x": [2, 5, 16], "m": [2, 5]}
    assert [d.dim_value for d in spec.graph.output[0].type.tensor_type.shape.dim] == [2, 5, 16]
    cm = tvmfuse.compile(model, target=host, input_shapes={"x": [2, 5, 16]})   # x pins m too
    assert [s.shape for s in cm.inputs] == [(2, 5, 16), (2, 5)]
    feeds = _feeds(rng, {"x": (2, 5, 16), "m": (2, 5)})
    np.testing.assert_allclose(cm.run(feeds)["y"], M.reference_outputs(model, feeds)["y"], rtol=1e-6)


def test_partial_pin_leaves_the_other_dim_symbolic():
    spec = specialize_inputs(_two_inputs(), {"batch": 2})
    assert symbolic_dims(spec) == {"seq": [("x", 1), ("m", 1)]}


def test_pinning_makes_the_shape_chain_foldable(host, rng):
    model = _reshape_by_shape_chain()
    assert fold_static_shapes(model)[1] == 0            # symbolic batch: nothing folds
    folded, n = fold_static_shapes(specialize_inputs(model, {"batch": 4}))
    assert n >= 4                                       # Shape, Gather, Unsqueeze, Concat
    assert not any(node.op_type in ("Shape", "Gather", "Concat") for node in folded.graph.node)
    cm = tvmfuse.compile(model, target=host, input_shapes={"batch": 4})
    feeds = _feeds(rng, {"x": (4, 8, 4)})
    np.testing.assert_allclose(cm.run(feeds)["y"], M.reference_outputs(model, feeds)["y"], rtol=1e-6)


# ----------------------------------------------------------------------------------- bad pins
@pytest.mark.parametrize("pins, match", [
    ({"z": [1, 64]}, r"'z'.*neither an input of the model \(\['x'\]\) nor one of its symbolic dims \(\['batch'\]\)"),
    ({"x": [1, 64, 1]}, r"input 'x' has rank 2 .*rank 3"),
    ({"x": [2, 63]}, r"input 'x': input_shapes gives 63 for axis 1, which the model fixes to 64"),
    ({"batch": 0}, r"input_shapes\['batch'\]: dimensions must be positive integers, got 0"),
    ({"batch": [2, 3]}, r"symbolic dim 'batch' takes one size"),
    ({"x": [2, 64], "batch": 3}, r"symbolic dim 'batch' is 2 by input_shapes\['x'\] but 3 by"),
    ({"x": "2,64"}, r"input_shapes\['x'\] must be a list of ints"),
])
def test_bad_pin_names_the_cause(pins, match):
    with pytest.raises(InputError, match=match):
        specialize_inputs(_mlp(), pins)


def test_two_inputs_pinning_one_dim_differently_is_an_error():
    with pytest.raises(InputError, match=r"symbolic dim 'seq' is 5 by input_shapes\['x'\] but 6 by input_shapes\['m'\]"):
        specialize_inputs(_two_inputs(), {"x": [2, 5, 16], "m": [2, 6]})


def test_input_shapes_on_an_irmodule_is_an_error(host):
    mod = tvmfuse.load_onnx(_mlp(4))
    with pytest.raises(InputError, match="applies to ONNX models"):
        tvmfuse.compile(mod, target=host, input_shapes={"x": [4, 64]})


def test_parse_shape_args():
    assert parse_shape_args(["x=1,128", "batch=8"]) == {"x": [1, 128], "batch": [8]}
    assert parse_shape_args([]) == {}
    for bad, match in [("x", "expected NAME=D1,D2"), ("x=", "expected NAME="), ("x=1,a", "must be integers"),
                       ("=3", "expected NAME=")]:
        with pytest.raises(InputError, match=match):
            parse_shape_args([bad])
    with pytest.raises(InputError, match="gives 'x' twice"):
        parse_shape_args(["x=1", "x=2"])


# ----------------------------------------------------------------------------------- command line
@pytest.fixture
def dyn_path(tmp_path):
    p = tmp_path / "mlp_dyn.onnx"
    onnx.save(_mlp(), p)
    return str(p)


def test_cli_report_and_explain_take_shape(dyn_path, capsys):
    assert main(["report", dyn_path, "--shape", "batch=4", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["after"]["kernels"] == 1
    assert main(["explain", dyn_path, "--shape", "x=2,64", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kernels_fused"] == 1 and d["refused"] == []


def test_cli_run_with_shape_uses_random_inputs_of_that_shape(dyn_path, tmp_path, capsys):
    out = tmp_path / "out.npz"
    assert main(["run", dyn_path, "--shape", "batch=3", "-o", str(out)]) == 0
    with np.load(out) as z:
        assert z["y"].shape == (3, 32)
    # symbolic inputs and no --inputs, no --shape: one line naming the input
    assert main(["run", dyn_path]) == 2
    assert "input 'x' has symbolic dims ['batch', 64]: give --inputs, or pin them with --shape" in \
        capsys.readouterr().err


def test_cli_export_and_compile_take_shape(dyn_path, tmp_path):
    art = tmp_path / "art"
    assert main(["export", dyn_path, "--shape", "batch=2", "-o", str(art)]) == 0
    runner = tvmfuse.load(str(art))
    assert [s.shape for s in runner.inputs] == [(2, 64)]
    assert main(["compile", dyn_path, "--shape", "x=5,64", "-o", str(tmp_path / "art2")]) == 0
    assert [s.shape for s in tvmfuse.load(str(tmp_path / "art2")).inputs] == [(5, 64)]


@pytest.mark.parametrize("argv_tail, match", [
    (["--shape", "q=1"], "'q', which is neither an input"),
    (["--shape", "x=1,2,3"], "input 'x' has rank 2"),
    (["--shape", "x=1;2"], "dimensions must be integers"),
])
def test_cli_bad_shape_is_one_line(dyn_path, capsys, argv_tail, match):
    assert main(["report", dyn_path, *argv_tail]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tvmfuse: error: ") and match in err and "Traceback" not in err


def test_tune_parser_takes_shape(dyn_path):
    from tvmfuse.cli import build_parser
    from tvmfuse.tune.cli import _model

    args = build_parser().parse_args(["tune", dyn_path, "--trials", "1", "--log", "l.jsonl", "--shape", "batch=2"])
    m = _model(args)
    assert isinstance(m, onnx.ModelProto)
    assert [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim] == [2, 64]
    # left symbolic: tuning needs concrete sizes, one error line naming the dim
    args = build_parser().parse_args(["tune", dyn_path, "--trials", "1", "--log", "l.jsonl"])
    with pytest.raises(InputError, match=r"symbolic dims \['batch'\].*--shape batch=1"):
        _model(args)
