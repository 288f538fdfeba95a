"""The fixed cost of ``run()`` over the VM call, step by step (issue 11: ``run()`` within 5% of the VM call).
Table 3c of ``benchmarks/README.md``: one command prints it (markdown, parts (a) and (b)) and writes the JSON.

    TVM_NUM_THREADS=1 python benchmarks/io_overhead.py     # -> benchmarks/io_overhead.json + Table 3c
    python benchmarks/io_overhead.py --quick --json /tmp/io_overhead.json

Models: two tiny ones (the kernels take about a microsecond, so what is timed is the Python around them):
LayerNorm over [2, 16] (one input) and the sigmoid chain over 64 elements (three inputs); and the
``resnet_block`` workload of ``bench_cpu.py`` (one input of 100 KB, a kernel of a few hundred us: there
run()'s steps run after the kernel has swept the caches); ``resnet_4x4_batch``, a tiny ResNet block with a
symbolic batch (run at batch 1: the symbolic models' path, ``_Plan.run_symbolic``).  Each compiled and as
an exported artifact (``Runner.run``: the same code, ``tvmfuse.io``).  Per model, microseconds per call of:

- ``vm_call``: the VM's ``main`` on device tensors (TVM's own copies of the inputs; Table 3's baseline),
  ``vm_views``: on DLPack views of the very numpy arrays ``run()`` gets (the same memory);
- ``run``: ``run(feeds)`` (numpy in, numpy out; the result dropped before the next call),
  ``run_method``: ``run()`` reached through the class's method (a plan lookup, then the static path: how
  every call went before a static model's ``run`` became the static path itself; the A/B pair of ``run``),
  ``run_kept``: the same with each result kept until the next call (a caller that holds its outputs),
  ``run_out``: ``run(feeds, outputs=...)`` into preallocated arrays (one copy per output),
  ``bind_run``: ``bind(feeds).run()`` (``bind_run_out``: with ``outputs=``), ``run_general``: ``run()``
  without its fast path (``_Plan.run_static`` / ``run_symbolic``): ``_Plan.in_place``'s checks, the path
  before io9 for symbolic models;
- run()'s steps (ours), each on its own, the timing loop's own cost (``empty``) taken off:
  ``input_checks`` (the static path's per-input tests, a replica), ``dlpack_import`` (a fresh DLPack
  import of every input: what an array not seen in the last call costs), ``output_refs`` (the reference
  count read that tells a fresh result from a shared one), ``output_ptr`` (the result is not an input's
  memory), ``output_view`` (``np.from_dlpack`` of a result), ``result_dict``; also ``checks``
  (``_Plan.in_place``, the symbolic path's) and ``full_checks`` (``validate_feeds`` + ``_to_device``:
  feeds that fail the plan);
- the VM call's parts (TVM's): ``ffi_call`` (a Python -> C++ call of a function that does nothing),
  ``kernels`` (the program's kernels called alone on tensors of their shapes); the VM's own work (its
  parameter checks, allocation from its pool, interpreter, the crossing to and from Python) is the VM call
  minus both, also per VM instruction (the program's instructions are counted from its text).

Also per path, minor page faults per call (``run_keep_all``: a caller that keeps 50 results before
letting them go) and the Python and C function calls one call makes (``sys.setprofile``): counts, not
timings, the same under any load.

Clock: with ``TVM_NUM_THREADS=1`` the calling thread's CPU time (other processes' load does not count in
it); else wall time.  Paths are timed in blocks of back-to-back calls, interleaved round by round with the
order rotated; the table gives paired per-round differences (median [p25-p75]).  Under load, read the
paired differences, not the absolute figures.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time

import numpy as np

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import io as IO
from tvmfuse import models as M

HERE = os.path.dirname(os.path.abspath(__file__))

MODELS = {
    "layernorm_2x16": (lambda: M.layernorm(rows=2, d=16, decomposed=False), 2000),
    "sigmoid_chain_64": (lambda: M.elementwise_chain(n=64), 2000),
    "resnet_block": (lambda: M.resnet_block(), 40),
    # a symbolic batch (run at batch 1): run()'s symbolic path (``_Plan.run_symbolic``), tiny kernels
    "resnet_4x4_batch": (lambda: M.resnet_block(channels=4, size=4, batch="batch"), 2000),
}


def paths(m, feeds, cm) -> dict:
    """name -> callable: the VM calls, the public calls, run()'s steps (ours) and the VM's (TVM's), each
    step on its own (``STEP_PATHS``; ``empty``, the timing loop's own cost, is taken off them)."""
    f = m._main()
    device_args = [C.tensor(feeds[s.name]) for s in m.inputs]
    views = [C.from_dlpack(feeds[s.name]) for s in m.inputs]
    bound = m.bind(feeds)
    plan = m._io_plan()
    held = f(*views)
    outs = {s.name: np.empty([d if isinstance(d, int) else 1 for d in s.shape], s.dtype) for s in m.outputs}
    kept = [None]
    general = _without_static_path(m)
    arrays = [feeds[s.name] for s in m.inputs]
    ptrs = [v.data_ptr() for v in views]
    out_name = m.outputs[0].name
    view = np.from_dlpack(held) if type(held) is C.Tensor else None
    method = type(m).run
    return {
        "vm_call": lambda: f(*device_args),
        "vm_views": lambda: f(*views),
        "run": lambda: m.run(feeds),
        "run_method": lambda: method(m, feeds),
        "run_general": lambda: general.run(feeds),
        "run_kept": lambda: kept.__setitem__(0, m.run(feeds)),
        "run_out": lambda: m.run(feeds, outputs=outs),
        "bind_run": bound.run,
        "bind_run_out": lambda: bound.run(outputs=outs),
        "empty": lambda: None,
        "input_checks": _static_checks(plan, feeds),
        "checks": lambda: plan.in_place(feeds),
        "dlpack_import": lambda: [C.from_dlpack(a) for a in arrays],
        "full_checks": lambda: [m._to_device(v)[0] for v in IO.validate_feeds(feeds, m.inputs)],
        "output_refs": lambda: C.strong_ref_word(held.__chandle__()).value <= 2,     # as run() reads it (io10)
        "output_ptr": lambda: type(held) is C.Tensor and held.data_ptr() not in ptrs,
        "output_view": lambda: np.from_dlpack(held) if type(held) is C.Tensor else None,
        "result_dict": lambda: {out_name: view},
        **vm_steps(m, cm),
    }


def _static_checks(plan, feeds):
    """The fast path's per-input tests for every input, as one callable (a replica for timing them alone):
    ``tvmfuse.io._static_run``'s (type, shape, dtype, flags, the last call's DLPack view reused) or, for a
    symbolic model, ``_symbolic_run``'s (the shapes compared, as a tuple, with the last that passed)."""
    specs = [(name, dtype, shape) for name, dtype, shape, _, _ in plan.checks]
    last = plan.last
    ndarray = np.ndarray
    if all(shape is not None for _, _, shape in specs):
        def checks():
            args = []
            for i, (name, dtype, shape) in enumerate(specs):
                v = feeds.get(name)
                if (type(v) is not ndarray or v.shape != shape or (v.dtype is not dtype and v.dtype != dtype)
                        or not v.flags.carray):
                    return None
                seen = last[i] if last is not None else None
                args.append(seen[1] if seen is not None and seen[0] is v else None)
            return args

        return checks
    passed = tuple(feeds[name].shape for name, _, _ in specs)

    def symbolic_checks():
        args, shapes = [], []
        for i, (name, dtype, _) in enumerate(specs):
            v = feeds.get(name)
            if type(v) is not ndarray or (v.dtype is not dtype and v.dtype != dtype) or not v.flags.carray:
                return None
            shape = v.shape
            seen = last[i] if last is not None else None
            args.append(seen[1] if seen is not None and seen[0] is v and seen[3] == shape else None)
            shapes.append(shape)
        return args if tuple(shapes) == passed else None

    return symbolic_checks


def vm_program(cm) -> dict:
    """The VM's ``main`` as a count of its instructions by callee (``vm.builtin.*`` by name, the
    kernels as ``kernel``) and the kernels' names in call order, from the executable's text."""
    counts: dict = {}
    kernels = []
    body = cm.executable.as_text().split("@main:", 1)[1].split("\n\n", 1)[0]
    for line in body.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] == "call":
            callee = words[1]
            kind = callee if callee.startswith("vm.builtin.") else "kernel"
            if kind == "kernel":
                kernels.append(callee)
        else:
            kind = words[0]
        counts[kind] = counts.get(kind, 0) + 1
    return {"instructions": counts, "kernels": kernels}


def _library(m):
    """The runtime module holding ``m``'s kernels (a compiled model's executable, an artifact's library)."""
    return m.module if hasattr(m, "module") else m.executable.mod


def vm_steps(m, cm) -> dict:
    """What of the VM call can be timed from Python on its own (TVM's side): ``ffi_call`` (a Python -> C++
    call of a function that does nothing, ``vm.builtin.null_value``) and ``kernels`` (every kernel of the
    program called once on tensors of its parameters' shapes: its packed-API checks and body).  The rest
    of the VM call, the VM's own work (its parameter checks, the outputs' and intermediates' allocation from
    its pool, the interpreter, the arguments and result crossing to and from Python), is derived
    (``vm_table_row``): its builtins called from Python would time mostly their argument conversion."""
    lib = _library(m)
    rng = np.random.default_rng(1)
    calls = []
    if any(isinstance(d, str) for spec in m.inputs for d in spec.shape):
        return {"ffi_call": C.global_func("vm.builtin.null_value")}     # kernels with shape arguments: not timed
    for name in vm_program(cm)["kernels"]:
        params = C.prim_func_params(cm.fused_module[name])
        calls.append((lib.get_function(name, query_imports=True),
                      [C.tensor(rng.standard_normal(shape).astype(dtype)) for shape, dtype in params]))

    def kernels():
        for fn, args in calls:
            fn(*args)

    return {"ffi_call": C.global_func("vm.builtin.null_value"), "kernels": kernels}


OUR_STEPS = ("input_checks", "dlpack_import", "output_refs", "output_ptr", "output_view", "result_dict")
VM_STEPS = ("ffi_call", "kernels")


def _without_static_path(m):
    """A copy of ``m`` (the same VM) whose ``run()`` does not take the static path: the A/B pair of run()."""
    g = copy.copy(m)
    g.__dict__.pop("_plan", None)
    g.__dict__.pop("run", None)
    plan = IO._Plan(g)
    plan.run_static = None
    if hasattr(plan, "run_symbolic"):
        plan.run_symbolic = None
    g.__dict__["_plan"] = plan
    return g


def _block(fn, calls: int, clock=time.perf_counter_ns) -> float:
    """Microseconds per call of ``calls`` back-to-back calls of ``fn``."""
    t = clock()
    for _ in range(calls):
        fn()
    return (clock() - t) / calls / 1e3


FAULT_PATHS = ("vm_call", "vm_views", "run", "run_kept", "run_out", "bind_run", "run_keep_all")


def page_faults(ps: dict, calls: int = 200) -> dict:
    """Minor page faults per call of each path after 20 warm-up calls (``getrusage``; not a timing, so
    load does not blur it): 0 where the outputs' memory comes back from the VM's pool every call."""
    import resource

    out = {}
    for k in FAULT_PATHS:
        for _ in range(20):
            ps[k]()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(calls):
            ps[k]()
        out[k] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
    return out


CALL_PATHS = ("vm_views", "run", "run_method", "run_general", "run_out", "bind_run", "bind_run_out")


def function_calls(ps: dict) -> dict:
    """Python and C function calls made by one call of each path (``sys.setprofile``; the path's own
    callable not counted): a count of run()'s steps that load does not change."""
    import sys

    out = {}
    for k in CALL_PATHS:
        ps[k]()
        count = [0]

        def profile(frame, event, arg):
            if event in ("call", "c_call"):
                count[0] += 1

        sys.setprofile(profile)
        try:
            ps[k]()
        finally:
            sys.setprofile(None)
        out[k] = count[0] - 1
    return out


def _spread(d) -> list:
    return [float(np.median(d)), float(np.percentile(d, 25)), float(np.percentile(d, 75))]


OVER_VM = ("vm_call", "run", "run_method", "run_general", "run_kept", "run_out", "bind_run", "bind_run_out")


def measure(m, feeds, cm, calls: int, rounds: int, clock) -> dict:
    ps = paths(m, feeds, cm)
    keep_all = []                        # a caller that keeps every result (up to 50, then lets them go)
    ps_faults = {**ps, "run_keep_all": lambda: keep_all.append(m.run(feeds)) if len(keep_all) < 50
                 else keep_all.clear()}
    keys = list(ps)
    for fn in ps.values():
        _block(fn, max(1, calls // 4), clock)
    times = {k: [] for k in keys}
    for r in range(rounds):
        k0 = r % len(keys)
        for k in keys[k0:] + keys[:k0]:
            times[k].append(_block(ps[k], calls, clock))
    faults = page_faults(ps_faults)
    fcalls = function_calls(ps)
    t = {k: np.array(v) for k, v in times.items()}
    out = {"us_median": {k: float(np.median(v)) for k, v in times.items()},
           "us_min": {k: float(min(v)) for k, v in times.items()}, "us_by_round": times,
           "minor_faults_per_call": faults, "function_calls_per_call": fcalls,
           # paired per round: each path minus the VM call on views of the same arrays (median, p25, p75)
           "over_vm_views_us": {k: _spread(t[k] - t["vm_views"]) for k in OVER_VM},
           # each step alone, minus the timing loop's own cost (``empty``) in the same round
           "steps_us": {k: _spread(t[k] - t["empty"]) for k in OUR_STEPS + VM_STEPS + ("checks", "full_checks")
                        if k in t}}
    for base in ("vm_views", "vm_call"):         # the keys of earlier JSONs
        out[f"run_minus_{base}_us"] = _spread(t["run"] - t[base])
    return out


def vm_table_row(row: dict) -> dict:
    """The VM call's parts (us): the Python -> C++ call into it, its kernels (without the Python -> C++ call
    each took to time it alone) and the VM's own work (derived: the rest), also per VM instruction."""
    st = {k: v[0] for k, v in row["steps_us"].items()}
    ffi = st["ffi_call"]
    vm = row["us_median"]["vm_views"] - row["us_median"]["empty"]
    if "kernels" not in st:            # a symbolic model: its kernels are not timed alone
        return {"ffi_call": ffi, "kernels": float("nan"), "vm_own": float("nan"),
                "vm_own_per_instruction": float("nan"), "vm_views": vm}
    kernels = st["kernels"] - len(row["program"]["kernels"]) * ffi
    rest = vm - ffi - kernels
    return {"ffi_call": ffi, "kernels": kernels, "vm_own": rest,
            "vm_own_per_instruction": rest / sum(row["program"]["instructions"].values()), "vm_views": vm}


def _f(x, digits=2) -> str:
    return "-" if x != x else f"{x:.{digits}f}"


def print_tables(rows: list, header: str) -> None:
    """Table 3c, markdown: (a) run()'s paths over the VM call, (b) the steps of run() and of the VM call."""
    print(f"\n### Table 3c (a): run() over the VM call, us per call ({header})\n")
    print("Paired per round: each path minus the VM's `main` on DLPack views of the same arrays, median [p25-p75].\n")
    print("| model | kind | path | inputs | VM instructions (kernels) | VM call on views | run() | run() via the "
          "class method | run() without the fast path | run(), result kept | run(outputs=) | bind().run() | "
          "bind().run(outputs=) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        o = r["over_vm_views_us"]
        prog = r["program"]
        cell = lambda k: f"+{_f(o[k][0])} [{_f(o[k][1])}, {_f(o[k][2])}]"   # noqa: E731
        print(f"| {r['model']} | {r['kind']} | {r['fast_path']} | {r['inputs']} | {sum(prog['instructions'].values())} "
              f"({len(prog['kernels'])}) | {_f(r['us_median']['vm_views'])} | {cell('run')} | {cell('run_method')} | "
              f"{cell('run_general')} | {cell('run_kept')} | {cell('run_out')} | {cell('bind_run')} | "
              f"{cell('bind_run_out')} |")
    print(f"\n### Table 3c (b): the steps, us per call, each timed alone ({header})\n")
    print("Ours: the static path's input checks (all inputs; the last call's DLPack view reused), the result "
          "tests (reference count; not an input's memory), the numpy view, the result dict; a DLPack import "
          "per input when an array object is new. TVM's: the Python -> C++ call, the kernels (called alone, "
          "net of that call), the VM's own work (derived: the VM call minus both; its parameter checks, "
          "allocation from its pool, interpreter, arguments and result to and from Python).\n")
    print("| model | kind | input checks | result: refs | result: not an input | numpy view | result dict | "
          "ours, sum | run() - VM, measured | DLPack import, new arrays | Python -> C++ call | kernels | "
          "VM's own work | per VM instruction | VM call |")
    print("|---|---|" + "---:|" * 13)
    for r in rows:
        st = {k: v[0] for k, v in r["steps_us"].items()}
        ours = sum(st[k] for k in OUR_STEPS if k != "dlpack_import")
        v = vm_table_row(r)
        print(f"| {r['model']} | {r['kind']} | " + " | ".join(_f(st[k]) for k in
              ("input_checks", "output_refs", "output_ptr", "output_view", "result_dict"))
              + f" | {_f(ours)} | {_f(r['over_vm_views_us']['run'][0])} | {_f(st['dlpack_import'])} | "
              + " | ".join(_f(v[k]) for k in ("ffi_call", "kernels", "vm_own", "vm_own_per_instruction", "vm_views"))
              + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21, help="blocks per path (interleaved)")
    ap.add_argument("--scale", type=float, default=1.0, help="calls per block: this times each model's default")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--quick", action="store_true", help="5 rounds of a tenth of the calls (a smoke run)")
    ap.add_argument("--json", default=os.path.join(HERE, "io_overhead.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.scale = 5, 0.1
    threads = os.environ.get("TVM_NUM_THREADS")
    clock, clock_name = ((time.thread_time_ns, "thread CPU time") if threads == "1"
                         else (time.perf_counter_ns, "wall time"))
    work = tempfile.mkdtemp(prefix="io-overhead-")
    rows = []
    load_start = os.getloadavg()
    print(f"TVM_NUM_THREADS={threads or '(default)'}, clock: {clock_name}, load average {load_start}")
    for name in args.models:
        make, calls = MODELS[name]
        model = make()
        rng = np.random.default_rng(0)
        cm = tvmfuse.compile(model, tuning_log=None)
        # a symbolic dim at 1
        feeds = {s.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in s.shape]).astype(s.dtype)
                 for s in cm.inputs}
        program = vm_program(cm)
        for kind, m in [("compiled", cm), ("artifact", tvmfuse.load(tvmfuse.export(cm, os.path.join(work, name))))]:
            n = max(1, int(calls * args.scale))
            r = measure(m, feeds, cm, n, args.rounds, clock)
            rows.append({"model": name, "kind": kind, "inputs": len(m.inputs), "calls": n,
                         "fast_path": m._io_plan().path, "program": program, **r})
            d = r["over_vm_views_us"]["run"]
            print(f"{name} {kind}: VM call on views {r['us_median']['vm_views']:.2f} us, run() +{d[0]:.2f} "
                  f"[{d[1]:.2f}, {d[2]:.2f}]; minor page faults per call: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r["minor_faults_per_call"].items())
                  + "; function calls per call: "
                  + ", ".join(f"{k} {v}" for k, v in r["function_calls_per_call"].items()), flush=True)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = (f"{date}, {C.llvm_system_cpu()}, TVM_NUM_THREADS={threads or '(default)'}, {clock_name}, "
              f"{args.rounds} rounds, load average {load_start[0]:.1f} at the start, "
              f"{os.getloadavg()[0]:.1f} at the end")
    print_tables(rows, header)
    out = {"date": date, "cpu": C.llvm_system_cpu(),
           "tvm_num_threads": threads, "clock": clock_name, "load_avg_start": load_start,
           "load_avg_end": os.getloadavg(), "rounds": args.rounds, "quick": args.quick, "rows": rows}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
