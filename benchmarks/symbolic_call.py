"""Per-call work of a symbolic model outside its kernels (issue 13): the VM builtins ``main`` runs per call and
the time of a call, symbolic against a build pinned to the size (and a bounded build, ``--shape-bound``).

    PYTHONPATH=. python benchmarks/symbolic_call.py bert --dims batch=1,sequence=1 --json out.json
    PYTHONPATH=. python benchmarks/symbolic_call.py resnet18 --dims batch=1 --shape-bound batch=64

Each build of the corpus model's ``_dyn`` variant (``symbolic``: any size; ``bounded``: ``shape_upper_bounds``
from ``--shape-bound``; ``static``: ``input_shapes`` pinned to ``--dims``) runs once under a VM instrument
that counts every call ``main`` makes: kernels, and each VM builtin by name (``vm.builtin.make_shape``,
``alloc_storage``, ``alloc_tensor``, ``null_value``: what a symbolic model adds per call); the VM instructions of each bytecode function
are counted from the executable's text.  Then the builds are timed in ``--rounds``
interleaved rounds of ``--repeat`` back-to-back calls, two paths each: the VM call on inputs placed once
(``vm``) and ``run()`` on the numpy feeds (``run``: + its input checks and output views).  By default one
runtime thread, timed on the calling thread's CPU time (``time.thread_time``), so that a loaded machine's
other processes count less; ``--threads 2 --clock wall`` times what a user sees on 2 threads (the thread's
CPU time leaves out the pool's other threads).  The min and median over rounds are reported, and each
build's ratio to ``static``.  On a shared machine label the numbers as measured under load.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_common import corpus_io, write_json  # noqa: E402

ROUNDS = 30      # interleaved rounds
REPEAT = 50      # back-to-back calls per round and path


def builtin_calls(cm, feeds: dict) -> dict[str, int]:
    """What one call of ``main`` calls: {"kernel": n, "<builtin name>": n, ...}."""
    from tvmfuse import _compat as C

    kernels = {gv.name_hint for gv, f in cm.fused_module.functions.items() if isinstance(f, C.PrimFunc)}
    counts: collections.Counter = collections.Counter()

    def instrument(func, symbol, before_run, ret_value, *args):
        if before_run:
            name = str(symbol)
            counts["kernel" if name in kernels else name] += 1
        return 0          # VMInstrumentReturnKind.NO_OP: run the call

    vm = C.VirtualMachine(cm.executable, cm.device)     # a VM of its own: the model's keeps no instrument
    vm.set_instrument(instrument)
    vm["main"](*[cm._to_device(v)[0] for v in _feeds_in_order(cm, feeds)])
    return dict(sorted(counts.items()))


def vm_instructions(cm) -> dict[str, int]:
    """VM instructions of each bytecode function of the executable (``main``), from its text."""
    counts: dict[str, int] = {}
    current = None
    for line in cm.executable.as_text().splitlines():
        if line.startswith("@") and line.rstrip().endswith(":"):
            current = line[1:].rstrip()[:-1]
            counts[current] = 0
        elif line.startswith("@"):
            current = None                  # a packed function's declaration
        elif current is not None and line.strip():
            counts[current] += 1
    return counts


def _feeds_in_order(cm, feeds: dict) -> list:
    from tvmfuse.io import validate_feeds

    return validate_feeds(feeds, cm.inputs, cm.shape_upper_bounds)


CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}


def timed(builds: dict, feeds: dict, rounds: int, repeat: int, clock=time.thread_time) -> dict[str, dict]:
    """Per build and path ("vm", "run"): min and median us per call over interleaved rounds (``clock``)."""
    paths = {}
    for name, cm in builds.items():
        args = [cm._to_device(v)[0] for v in _feeds_in_order(cm, feeds)]
        f = cm._main()
        paths[(name, "vm")] = lambda f=f, args=args: f(*args)
        paths[(name, "run")] = lambda cm=cm: cm.run(feeds)
    for fn in paths.values():        # warm-up: first-call allocations, caches
        for _ in range(3):
            fn()
    per = {k: [] for k in paths}
    for _ in range(rounds):
        for k, fn in paths.items():
            t0 = clock()
            for _ in range(repeat):
                fn()
            per[k].append((clock() - t0) / repeat * 1e6)
    out: dict[str, dict] = {}
    for (name, path), ts in per.items():
        out.setdefault(name, {})[path] = {"min_us": min(ts), "median_us": float(np.median(ts))}
    return out


def _parse(text: str | None, option: str) -> dict:
    out = {}
    for part in (text or "").split(","):
        if not part:
            continue
        name, _, value = part.partition("=")
        if not name or not value.strip().isdigit():
            raise SystemExit(f"{option} {text!r}: expected NAME=INT[,NAME=INT...]")
        out[name.strip()] = int(value)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [e["name"] for e in corpus_io.load_manifest()["models"]]
    ap.add_argument("model", choices=names)
    ap.add_argument("--dims", required=True, help="sizes of the symbolic dims, e.g. batch=1,sequence=1")
    ap.add_argument("--shape-bound", help="also a build with these shape_upper_bounds, e.g. batch=64")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--repeat", type=int, default=REPEAT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="runtime threads of every build (default 1)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="thread",
                    help="thread: the calling thread's CPU time (default); wall: elapsed time")
    ap.add_argument("--json", help="write the record here")
    a = ap.parse_args(argv)

    import tvmfuse

    entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[a.model]
    dims = _parse(a.dims, "--dims")
    bounds = _parse(a.shape_bound, "--shape-bound")
    path = corpus_io.model_path(entry, "dynamic")
    builds = {"static": tvmfuse.compile(path, input_shapes=dims, num_threads=a.threads),
              "symbolic": tvmfuse.compile(path, num_threads=a.threads)}
    if bounds:
        builds["bounded"] = tvmfuse.compile(path, shape_upper_bounds=bounds, num_threads=a.threads)
    feeds = corpus_io.random_feeds(entry, np.random.default_rng(a.seed), dims=dims)
    rec = {"model": a.model, "dims": dims, "shape_upper_bounds": bounds, "threads": a.threads,
           "clock": {"thread": "thread_time", "wall": "perf_counter"}[a.clock], "rounds": a.rounds,
           "repeat": a.repeat, "builds": {}}
    for name, cm in builds.items():
        rec["builds"][name] = {"kernels": cm.kernel_count, "vm_instructions": vm_instructions(cm),
                               "calls_per_call": builtin_calls(cm, feeds)}
    times = timed(builds, feeds, a.rounds, a.repeat, CLOCKS[a.clock])
    for name, t in times.items():
        rec["builds"][name]["time"] = t
        for path_name in ("vm", "run"):
            t[path_name]["ratio_to_static_min"] = t[path_name]["min_us"] / times["static"][path_name]["min_us"]
    for name, b in rec["builds"].items():
        c = b["calls_per_call"]
        print(f"{name:9s} kernels {b['kernels']:3d}  instrs {'/'.join(map(str, b['vm_instructions'].values())):>9s}  "
              f"make_shape {c.get('vm.builtin.make_shape', 0):3d}  alloc_storage "
              f"{c.get('vm.builtin.alloc_storage', 0):3d}  alloc_tensor {c.get('vm.builtin.alloc_tensor', 0):3d}  "
              + "  ".join(f"{p} min {b['time'][p]['min_us']:7.1f} us med {b['time'][p]['median_us']:7.1f} "
                          f"({b['time'][p]['ratio_to_static_min']:.2f}x)" for p in ("vm", "run")))
    write_json(rec, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
