"""benchmarks/bench_cpu.py's checks and its MetaSchedule database route (tune once, compile from the stored
database): no timing, no tuning (the database is written by hand with one record)."""
import importlib.util
import json
import os

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M

from conftest import named_target

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_cpu", os.path.join(_ROOT, "benchmarks", "bench_cpu.py"))
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)

ROWS, D = 16, 64


def _model():
    return M.layernorm(rows=ROWS, d=D, decomposed=False)


def _hand_database(model, target, db_dir, trials=1):
    """A MetaSchedule JSON database in ``db_dir`` with one record for the layernorm task: its output
    block's outer loop parallel (what a tuning run would have stored), and the tuning info beside it."""
    ms = C.meta_schedule
    os.makedirs(db_dir, exist_ok=True)
    (task,) = B._ms_tasks(tvmfuse.load_onnx(model), target)
    mod = task.dispatched[0]
    sch = C.Schedule(mod)
    sch.parallel(sch.get_loops(sch.get_sblock("T_layer_norm"))[0])
    db = ms.database.JSONDatabase(work_dir=str(db_dir))
    workload = db.commit_workload(mod)
    db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [1e-3], target,
                                                     ms.arg_info.ArgInfo.from_prim_func(mod["main"])))
    with open(os.path.join(db_dir, B.MS_TUNING_INFO), "w") as f:
        json.dump({"database": str(db_dir), "trials_per_task": trials, "tasks": 1, "tuning_s": 0.0}, f)


def _loop_kinds(func):
    kinds = []
    C.post_order_visit(func.body, lambda n: kinds.append(int(n.kind)) if isinstance(n, C.tirx.For) else None)
    return kinds


def test_from_db_applies_the_stored_schedule(tmp_path):
    """Structural: static_shape_tuning with total_trials=0 on a folder with a record gives the recorded
    schedule (a parallel loop), and without the record TVM's default nest (no parallel loop)."""
    target = named_target("skx-2")
    _hand_database(_model(), target, tmp_path / "db")
    for db_dir, parallel in ((tmp_path / "db", True), (tmp_path / "empty", False)):
        os.makedirs(db_dir, exist_ok=True)
        with target:
            mod = C.relax_get_pipeline("static_shape_tuning", total_trials=0, target=target,
                                       work_dir=str(db_dir))(tvmfuse.load_onnx(_model()))
        (func,) = [f for _, f in mod.functions.items() if isinstance(f, C.PrimFunc)]
        assert (int(C.ForKind.PARALLEL) in _loop_kinds(func)) == parallel, db_dir


def test_from_db_build_matches_reference(tmp_path, host, rng):
    """Numeric: the executable compiled from the stored database computes the ONNX reference's outputs,
    and the row records the database's tuning info and that its one task had a record."""
    model = _model()
    _hand_database(model, host, tmp_path)
    ex, info = B._metaschedule(model, host, 0, str(tmp_path), from_db=True)
    assert info["from_db"] and info["tasks_with_records"] == 1 and info["trials_per_task"] == 1
    feeds = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in M.random_feeds(model).items()}
    ref = list(M.reference_outputs(model, feeds).values())
    out = B._as_arrays(B._vm_call(ex, feeds)())
    np.testing.assert_allclose(out[0], ref[0], rtol=B.CHECK_RTOL, atol=B.CHECK_ATOL)


def test_from_db_without_database_names_the_folder(tmp_path):
    with pytest.raises(ValueError, match="no MetaSchedule database.*database_workload.json"):
        B._ms_info(str(tmp_path), 0)


def test_from_db_refuses_another_trial_budget(tmp_path):
    _hand_database(_model(), named_target("skx-2"), tmp_path, trials=64)
    assert B._ms_info(str(tmp_path), 64)["trials_per_task"] == 64
    with pytest.raises(ValueError, match="--ms-trials 32 but .* 64 trials per task"):
        B._ms_info(str(tmp_path), 32)


def test_tuning_refuses_an_existing_database(tmp_path):
    """Tuning into a folder that has a database would mix two runs' records: refused before any tuning."""
    _hand_database(_model(), named_target("skx-2"), tmp_path)
    with pytest.raises(ValueError, match="already in"):
        B._ms_tune(tvmfuse.load_onnx(_model()), named_target("skx-2"), 4, str(tmp_path))


def test_resume_tunes_only_the_tasks_an_interrupted_run_left_without_records(tmp_path, monkeypatch, capsys):
    """--ms-resume (tuning stubbed: the task scheduler's call is recorded): an interrupted run's database (a
    record for resnet_block's first task, no tuning info) hands only the other task to tune_tasks, with the
    search seed that task has in a whole run and the budget of one task; the info names both.  Without
    --ms-resume that folder is refused naming the option; a finished database is refused by --ms-resume."""
    import types

    ms = C.meta_schedule
    target = named_target("skx-2")
    model = M.resnet_block(channels=8, size=8)
    tasks = B._ms_tasks(tvmfuse.load_onnx(model), target)
    assert len(tasks) == 2
    db_dir = str(tmp_path / "db")
    os.makedirs(db_dir)
    db = ms.database.JSONDatabase(work_dir=db_dir)
    kept = tasks[0].dispatched[0]
    sch = C.Schedule(kept)
    sch.get_sblock("compute")       # a trace with one step (a record with an empty trace is never a top-k)
    db.commit_tuning_record(ms.database.TuningRecord(sch.trace, db.commit_workload(kept), [1e-3],
                                                     target, ms.arg_info.ArgInfo.from_prim_func(kept["main"])))
    db.commit_workload(tasks[1].dispatched[0])        # the interrupted run had committed every workload
    with pytest.raises(ValueError, match="--ms-resume"):
        B._ms_tune(tvmfuse.load_onnx(model), target, 4, db_dir)
    with pytest.raises(ValueError, match="did not finish .*--ms-resume"):          # --ms-from-db on it
        B._ms_info(db_dir, 4)
    made, calls = [], []

    def fake_contexts(extracted_tasks, work_dir, space, strategy, seed):
        """TVM's: one TuneContext per task, in order, with seeds forked from ``seed`` (stand-ins here: making
        the real ones imports TVM's tensor intrinsics, a minute of CPU)"""
        made.append((list(extracted_tasks), seed))
        return ([types.SimpleNamespace(task_name=t.task_name, rand_state=(seed, i))
                 for i, t in enumerate(extracted_tasks)], [1.0] * len(extracted_tasks))

    monkeypatch.setattr(ms.relax_integration, "extracted_tasks_to_tune_contexts", fake_contexts)
    monkeypatch.setattr(ms.tune, "tune_tasks", lambda **kw: calls.append(kw))
    info = B._ms_tune(tvmfuse.load_onnx(model), target, 4, db_dir, resume=True)
    ((handed, seed),) = made
    assert [t.task_name for t in handed] == [t.task_name for t in tasks] and seed == B.MS_SEED   # every task
    (call,) = calls
    (ctx,) = call["tasks"]
    assert ctx.task_name == tasks[1].task_name and ctx.rand_state == (B.MS_SEED, 1)    # its whole-run seed
    assert call["max_trials_global"] == 4 and call["max_trials_per_task"] == 4 and call["work_dir"] == db_dir
    assert info["resumed"]["tasks_kept"] == [tasks[0].task_name]
    assert info["resumed"]["tasks_tuned"] == [tasks[1].task_name]
    assert info["tasks"] == 2 and info["trials_per_task"] == 4
    with open(os.path.join(db_dir, B.MS_TUNING_INFO)) as f:
        assert json.load(f)["resumed"] == info["resumed"]
    with pytest.raises(ValueError, match="finished"):
        B._ms_tune(tvmfuse.load_onnx(model), target, 4, db_dir, resume=True)
    for bad in (["--ms-from-db", "--ms-work-dir", str(tmp_path)], ["--ms-trials", "4"]):
        with pytest.raises(SystemExit):
            B.main(["--ms-resume", "--workloads", "qkv", *bad])
        assert "--ms-resume goes with --ms-trials N and --ms-work-dir DIR" in capsys.readouterr().err


def test_from_db_without_databases_for_this_cpu_exits(tmp_path, monkeypatch, capsys):
    """--ms-from-db without --ms-work-dir reads MS_DB_ROOT/<host mcpu>; none there: a usage error naming it."""
    monkeypatch.setattr(B, "MS_DB_ROOT", str(tmp_path))
    with pytest.raises(SystemExit):
        B.main(["--ms-from-db", "--no-models"])
    assert "no MetaSchedule databases for this CPU in " + str(tmp_path / C.llvm_system_cpu()) in capsys.readouterr().err


def test_default_work_dir_is_per_cpu():
    assert B.ms_default_work_dir(named_target("skx-2")) == os.path.join(B.MS_DB_ROOT, "skylake-avx512")
    assert B.ms_default_work_dir(named_target("neon-4")) == os.path.join(B.MS_DB_ROOT, "neoverse-n1")


@pytest.mark.parametrize("other", ["haswell-2", "skx-32", "neon-4"])
def test_from_db_refuses_a_database_of_another_target(tmp_path, other):
    """A database tuned for skylake-avx512 on 2 cores is refused for another CPU, core count or triple
    (MetaScheduleApplyDatabase would apply it silently: it matches records by workload only), with the
    differing field named; the same target is accepted."""
    _hand_database(_model(), named_target("skx-2"), tmp_path)
    assert B._ms_info(str(tmp_path), 0, named_target("skx-2"))["trials_per_task"] == 1
    field = {"haswell-2": "mcpu 'skylake-avx512' there, 'haswell' here", "skx-32": "num-cores 2 there, 32 here",
             "neon-4": "mtriple 'x86_64-linux-gnu' there, 'aarch64-linux-gnu' here"}[other]
    with pytest.raises(ValueError, match=f"tuned for another target \\(tuning record 1: .*{field}"):
        B._ms_info(str(tmp_path), 0, named_target(other))


def test_from_db_refuses_tuning_info_of_another_target(tmp_path):
    """The tuning info's target counts too (a database copied into another CPU's folder)."""
    _hand_database(_model(), named_target("skx-2"), tmp_path)
    info_path = tmp_path / B.MS_TUNING_INFO
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "target": str(named_target("haswell-2"))}))
    with pytest.raises(ValueError, match="tuning_info.json: mcpu 'haswell' there, 'skylake-avx512' here"):
        B._ms_info(str(tmp_path), 0, named_target("skx-2"))


def test_stored_databases_match_their_cpu_folder():
    """Every committed database under MS_DB_ROOT/<cpu>/<workload>/ was tuned for <cpu> (records and info)."""
    checked = 0
    for cpu in sorted(os.listdir(B.MS_DB_ROOT)):
        cpu_dir = os.path.join(B.MS_DB_ROOT, cpu)
        if not os.path.isdir(cpu_dir) or os.path.exists(os.path.join(cpu_dir, B.MS_TUNING_INFO)):
            continue                                   # a workload folder of the session-8 layout
        for wl in sorted(os.listdir(cpu_dir)):
            db_dir = os.path.join(cpu_dir, wl)
            if os.path.exists(os.path.join(db_dir, B.MS_TUNING_INFO)):
                with open(os.path.join(db_dir, B.MS_TUNING_INFO)) as f:
                    target = C.Target(json.loads(json.load(f)["target"]))
                assert str(target.attrs["mcpu"]) == cpu, db_dir
                B._ms_check_target(db_dir, target)
                checked += 1
    if checked == 0:
        pytest.skip(f"no per-CPU database under {B.MS_DB_ROOT}")


def test_load_sampler_records_the_load_during_the_run():
    with B._LoadSampler(every_s=0.01) as load:
        deadline = B.time.perf_counter() + 0.1
        while B.time.perf_counter() < deadline:
            pass
    s = load.summary()
    assert s["tuning_load_avg_1min_samples"] == len(load.samples) >= 3
    assert s["tuning_load_avg_1min_min"] <= s["tuning_load_avg_1min_mean"] <= s["tuning_load_avg_1min_max"]


def test_check_outputs_fails_on_wrong_values_and_shapes(tmp_path, rng):
    ref = [rng.standard_normal((4, 8)).astype(np.float32)]
    path = str(tmp_path / "out.npz")
    np.savez(path, out0=ref[0])
    assert B.check_outputs(path, ref)["check"] == "pass"
    np.savez(path, out0=ref[0] + 1e-2)
    assert B.check_outputs(path, ref)["check"] == "FAIL"
    np.savez(path, out0=ref[0][:2])
    assert "shape" in B.check_outputs(path, ref)["why"]


def test_paired_ratio_cancels_a_load_shared_by_both_blocks_of_a_round():
    """--io/--tails pair the two engines round by round: a slowdown that hits both blocks of a round (the
    machine's load) cancels in the per-round ratio, where the ratio of the two medians is moved by it;
    the bootstrap interval contains the median ratio; rounds that do not pair up give None."""
    load = [1.0, 1.6, 1.1, 2.0, 1.3, 1.0, 1.9, 1.2, 1.5, 1.05, 1.7]   # ms of the baseline per round
    base = list(load)
    num = [1.04 * b for b in base]                                      # 4% slower in every round
    num[1] = 1.04 * 1.0                                                 # ... except one round the load missed
    r = B.paired_ratio(num, base)
    assert abs(r["median"] - 1.04) < 1e-9 and r["rounds"] == len(base)
    assert abs(np.median(num) / np.median(base) - 1.04) > 0.05      # the medians' ratio: moved by that round
    assert r["ci"][0] <= r["median"] <= r["ci"][1] and r["p25"] <= r["median"] <= r["p75"]
    assert len(r["by_round"]) == len(base)
    assert B.paired_ratio(num[:-1], base) is None and B.paired_ratio([], []) is None
    rows = [{"workload": "w", "engines": {"tail_run": {"ms": {"by_round": num}},
                                          "tail_padded_run": {"ms": {"by_round": base}},
                                          "tail_vm": {"error": "x"}}}]
    got = B.paired_ratios(rows, B.TAIL_PAIRS)["w"]
    assert got["vm"] is None and abs(got["run"]["median"] - 1.04) < 1e-9


def test_spread_keeps_the_rounds_in_order():
    """``by_round`` is the rounds as timed (paired_ratio pairs them by position); ``rounds`` sorted."""
    s = B._spread([0.003, 0.001, 0.002])
    assert s["by_round"] == [3.0, 1.0, 2.0] and s["rounds"] == [1.0, 2.0, 3.0] and s["median"] == 2.0


def _aligned_at(value, offset):
    """A copy of ``value`` whose data starts ``offset`` bytes past a 64-byte line."""
    raw = np.empty(value.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    out = raw[start:start + value.nbytes].view(value.dtype).reshape(value.shape)
    out[...] = value
    return out


def test_io_engines_state_where_their_inputs_start(tmp_path, rng, monkeypatch):
    # --io's columns: the VM call gets TVM's 64-byte-aligned copies; the views and run() numpy copies of the
    # feeds made after the model is built, as a user's arrays (numpy's allocator as tvmfuse leaves it:
    # 64-byte aligned once a CPU model is compiled, tvmfuse.io.aligned_numpy); run_numpy16 copies made with
    # numpy's own allocator; run() aligned tvmfuse.empty arrays; each engine records it, and every engine
    # computes the same result
    from tvmfuse import io

    monkeypatch.setattr(B, "_BUILT", {})
    model = _model()
    x = rng.standard_normal((ROWS, D)).astype("float32")
    feeds = {"x": _aligned_at(x, 16)}
    assert feeds["x"].ctypes.data % 64 == 16
    B._io("io_vm", model, feeds, str(tmp_path))                 # compiles: the allocator is switched now
    aligned_numpy = io.numpy_allocator() == io.ALIGNED_HANDLER_NAME
    user = B._BUILT[("numpy_inputs", False)]["x"]
    at = user.ctypes.data % 64
    assert at == 0 or not aligned_numpy
    own = B._BUILT[("numpy_inputs", False, "16")]["x"]
    assert own is not user and np.array_equal(own, x) and np.array_equal(user, x)
    handler = io._multiarray().get_handler_name                 # which allocator made an array's memory
    assert handler(own) == io.NUMPY_DEFAULT_HANDLER_NAME
    assert handler(user) == (io.ALIGNED_HANDLER_NAME if aligned_numpy else io.NUMPY_DEFAULT_HANDLER_NAME)
    expect = {"io_vm": 0, "io_vm_views": at, "io_run_numpy": at, "io_run_numpy16": own.ctypes.data % 64,
              "io_run_aligned": 0, "io_run_same": 0,
              "io_artifact_vm": 0, "io_artifact_vm_views": None, "io_artifact_run_numpy": None,
              "io_artifact_run_numpy16": None, "io_artifact_run_aligned": 0, "io_artifact_run_same": 0}
    results = {}
    for engine, offset in expect.items():
        fn = B._io(engine, model, feeds, str(tmp_path))
        if offset is None:        # the artifact's copies, made when it is loaded
            key = ("numpy_inputs", True) + (("16",) if engine.endswith("16") else ())
            offset = B._BUILT[key]["x"].ctypes.data % 64
            assert offset == 0 or engine.endswith("16") or not aligned_numpy
        assert fn.info == {"input_offsets": {"x": offset}}, engine
        results[engine] = B._as_arrays(fn())[0]
    # run_same reads the very device tensors the VM call gets (one set per model, compiled and artifact)
    for prefix, artifact in (("", False), ("artifact_", True)):
        (t,) = B._BUILT[("device_args", artifact)]
        same = B._io(f"io_{prefix}run_same", model, feeds, str(tmp_path))
        assert same.info == {"input_offsets": {"x": t.data_ptr() % 64}}
        m = B._BUILT["artifact"] if artifact else B._BUILT["compiled"]
        same()
        assert m._io_plan().last[0][2] == t.data_ptr()      # run() took that memory in place, no copy
    ref = list(M.reference_outputs(model, {"x": x}).values())[0]
    for engine, got in results.items():
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5, err_msg=engine)
    # the pairs Table 3 reports include the two columns fed alike (aligned run() / VM call)
    assert B.IO_PAIRS["run_aligned/vm"] == ("io_run_aligned", "io_vm")
    assert B.IO_PAIRS["artifact_run_aligned/vm"] == ("io_artifact_run_aligned", "io_artifact_vm")
    assert B.IO_PAIRS["run_same/vm"] == ("io_run_same", "io_vm")
    assert B.IO_PAIRS["artifact_run_same/vm"] == ("io_artifact_run_same", "io_artifact_vm")


def test_align_ab_places_the_same_values_at_each_offset(rng):
    spec = importlib.util.spec_from_file_location("align_ab", os.path.join(_ROOT, "benchmarks", "align_ab.py"))
    A = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(A)
    x = rng.standard_normal((3, 5)).astype("float32")
    for offset in (0, 16, 48, 2080):
        y = A.placed(x, offset)
        assert y.ctypes.data % A.PAGE == offset and y.flags.c_contiguous and y.flags.writeable
        np.testing.assert_array_equal(y, x)


def test_torch_engine_converts_at_the_fallback_opset_or_says_why(monkeypatch):
    """torch_compile (no torch here: torch and onnx2torch stand-ins record what they are given): a model
    onnx2torch cannot convert at its opset (18) is converted at TORCH_FALLBACK_OPSET and the row says so; if
    that fails too, the engine is skipped naming both reasons."""
    import contextlib
    import sys
    import types

    seen = []

    def convert(model, ok_opsets):
        opset = model.opset_import[0].version
        seen.append(opset)
        if opset not in ok_opsets:
            raise NotImplementedError(f"Converter is not implemented (ReduceMean, version={opset})")
        return types.SimpleNamespace(eval=lambda: (lambda *a: "ran"), graph=types.SimpleNamespace(nodes=[]))

    fake_torch = types.ModuleType("torch")
    fake_torch.__version__ = "stand-in"
    fake_torch.set_num_threads = lambda n: None
    fake_torch.compile = lambda m: m
    fake_torch.from_numpy = lambda a: a
    fake_torch.inference_mode = contextlib.nullcontext
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    model = M.transformer_block()
    assert model.opset_import[0].version == 18
    monkeypatch.setattr(B, "_import_onnx2torch",
                        lambda: types.SimpleNamespace(convert=lambda m: convert(m, {B.TORCH_FALLBACK_OPSET})))
    run = B._torch(model, {}, 1)
    assert seen == [18, B.TORCH_FALLBACK_OPSET] and run.info["onnx2torch_opset"] == B.TORCH_FALLBACK_OPSET
    assert "ReduceMean, version=18" in run.info["onnx2torch_why"]
    seen.clear()
    monkeypatch.setattr(B, "_import_onnx2torch", lambda: types.SimpleNamespace(convert=lambda m: convert(m, {18})))
    assert B._torch(model, {}, 1).info == {"torch": "stand-in"} and seen == [18]     # converted as it is
    monkeypatch.setattr(B, "_import_onnx2torch", lambda: types.SimpleNamespace(convert=lambda m: convert(m, set())))
    with pytest.raises(B.Skipped, match="cannot convert the model .*version=18.*nor at opset 17 .*version=17"):
        B._torch(model, {}, 1)


    def failing_compile(m):
        def call(*a):
            raise TypeError("torch.Size() takes an iterable of 'int'\n\nfrom user code:\n  reshape.py, line 23")
        return call

    monkeypatch.setattr(fake_torch, "compile", failing_compile)
    monkeypatch.setattr(B, "_import_onnx2torch", lambda: types.SimpleNamespace(convert=lambda m: convert(m, {17})))
    with pytest.raises(B.Skipped, match=r"torch.compile failed on the onnx2torch module \(converted at opset 17 .*\): "
                       r"TypeError: torch.Size\(\) takes an iterable of 'int' from user code: reshape.py, line 23"):
        B._torch(model, {}, 1)


def test_reshape_to_constant_shape_copies_zero_dims_and_infers_minus_one(rng):
    """The folded Reshape (no torch needed: numpy arrays have the same reshape and shape) follows ONNX
    Reshape with allowzero=0: 0 copies the input's dim at that position, -1 is inferred."""
    x = rng.standard_normal((6, 4, 5)).astype(np.float32)
    assert B._reshape_to_constant_shape(x, (0, 2, -1)).shape == (6, 2, 10)
    assert B._reshape_to_constant_shape(x, (-1, 0)).shape == (30, 4)
    np.testing.assert_array_equal(B._reshape_to_constant_shape(x, (0, 20)), x.reshape(6, 20))
    with pytest.raises(ValueError):
        B._reshape_to_constant_shape(x, (7, -1))      # 120 elements are not 7 rows


def _reshape_model():
    """x [6, 4, 5] reshaped three ways: by an initializer with a 0 (copy dim 0), by a Constant node's
    output, and by a shape computed in the graph (Shape of another input), which must stay as it is."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Reshape", ["x", "s_init"], ["a"]),
             helper.make_node("Constant", [], ["s_const"],
                              value=numpy_helper.from_array(np.array([-1, 5], np.int64))),
             helper.make_node("Reshape", ["x", "s_const"], ["b"]),
             helper.make_node("Shape", ["like"], ["s_dyn"]),
             helper.make_node("Reshape", ["x", "s_dyn"], ["c"])]
    graph = helper.make_graph(
        nodes, "reshapes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 4, 5]),
         helper.make_tensor_value_info("like", TensorProto.FLOAT, [2, 60])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "abc"],
        initializer=[numpy_helper.from_array(np.array([0, 20], np.int64), "s_init")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_fold_constant_reshapes_folds_constant_shapes_only(rng):
    """onnx2torch's Reshape modules with a constant shape (initializer, Constant node) are folded, one with
    a computed shape is kept; the folded module gives the ONNX reference's outputs on fresh inputs.  Needs
    torch and onnx2torch (the corpus venv, see --torch-python): skipped without them."""
    pytest.importorskip("torch")
    B._import_onnx2torch()       # the torchvision placeholder, where torchvision's ops do not load
    onnx2torch = pytest.importorskip("onnx2torch")
    import torch
    from onnx.reference import ReferenceEvaluator

    model = _reshape_model()
    feeds = {"x": rng.standard_normal((6, 4, 5)).astype(np.float32),
             "like": rng.standard_normal((2, 60)).astype(np.float32)}
    gm = onnx2torch.convert(model)

    def reshape_modules():
        return [n for n in gm.graph.nodes
                if n.op == "call_module" and type(gm.get_submodule(n.target)).__name__ == "OnnxReshape"]

    assert len(reshape_modules()) == 3
    assert B._fold_constant_reshapes(gm) == 2
    (kept,) = reshape_modules()
    assert kept.args[1].op != "get_attr"            # the Shape-computed one
    folded = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is B._reshape_to_constant_shape]
    assert sorted(n.args[1] for n in folded) == [(-1, 5), (0, 20)]
    assert all(type(d) is int for n in folded for d in n.args[1])
    with torch.inference_mode():
        outs = gm(*(torch.from_numpy(v) for v in feeds.values()))
    for got, want in zip(outs, ReferenceEvaluator(model).run(None, feeds)):
        np.testing.assert_array_equal(got.numpy(), want)
    assert B._fold_constant_reshapes(gm) == 0       # nothing left to fold


def test_torch_engine_compiles_transformer_block(rng):
    """transformer_block's onnx2torch module (converted at opset 17, its 4 constant-shape Reshapes folded)
    traces under dynamo (torch.compile's front end; backend "eager" to keep the test cheap) and matches the
    ONNX reference on fresh inputs.  Before the fold dynamo failed on onnx2torch's Reshape (torch.Size of a
    tensor).  Needs torch and onnx2torch: skipped without them."""
    pytest.importorskip("torch")
    B._import_onnx2torch()
    onnx2torch = pytest.importorskip("onnx2torch")
    import torch
    from onnx import version_converter
    from onnx.reference import ReferenceEvaluator

    model = M.transformer_block()
    feeds = {"x": rng.standard_normal((64, 128)).astype(np.float32)}
    gm = onnx2torch.convert(version_converter.convert_version(model, B.TORCH_FALLBACK_OPSET))
    assert B._fold_constant_reshapes(gm) == 4
    torch._dynamo.reset()
    net = torch.compile(gm.eval(), backend="eager", fullgraph=True)
    with torch.inference_mode():
        got = net(torch.from_numpy(feeds["x"]))
    (want,) = ReferenceEvaluator(model).run(None, feeds)
    np.testing.assert_allclose(got.numpy(), want, rtol=B.CHECK_RTOL, atol=B.CHECK_ATOL)


def test_worker_close_kills_a_worker_that_does_not_quit(tmp_path, monkeypatch, capsys):
    import subprocess
    import sys

    monkeypatch.setattr(B, "WORKER_EXIT_TIMEOUT_S", 0.5)
    w = object.__new__(B.Worker)
    w.engine, w.workload = "stuck", "wl"
    w.log = open(tmp_path / "log", "w")
    w.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE, text=True)
    w.close()
    assert w.proc.returncode is not None and w.proc.returncode != 0 and w.log.closed
    assert "stuck worker for wl" in capsys.readouterr().err


def test_printed_error_is_the_exception_line_not_the_traceback_head():
    err = 'worker exited (1): Traceback (most recent call last):\n  File "x.py", line 3\nValueError: no database in /d\n'
    assert B._error_cause(err) == "ValueError: no database in /d"
    assert B._error_cause("E: " + "x" * 400, chars=10) == "E: xxxxxxx..." and B._error_cause("") == "(no message)"


def test_tvmfuse_engine_runs_on_the_threads_asked_for(rng):
    """``--threads 1`` times tvmfuse on one thread: tvmfuse.compile sizes TVM's pool to its own num_threads
    (default: the physical cores), so build_engine sizes it again after the build (conv12: before, the
    "one thread" row of conv3x3_bn_relu_res ran on 2)."""
    from tvmfuse.target import configure_threads, physical_cores

    if physical_cores() < 2:
        pytest.skip("one core: the pool has one thread whatever the engine asks")
    model = _model()
    try:
        for engine in ("tvmfuse", "tvmfuse_separate"):
            fn = B.build_engine(engine, model, M.random_feeds(model), 1, {}, None)
            fn()
            assert C.runtime_threads() == 1, engine
    finally:
        configure_threads(None)
