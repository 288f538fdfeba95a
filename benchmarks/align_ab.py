"""Does where an input starts (its byte offset past a 64-byte line) change the kernels' time? (issue 11)

    TVM_NUM_THREADS=1 python benchmarks/align_ab.py                 # -> benchmarks/align_ab.json
    TVM_NUM_THREADS=1 python benchmarks/align_ab.py --quick --json /tmp/align_ab.json

Table 3 (``bench_cpu.py --io``) read resnet_block's run() / VM call 1.10 while every other workload was
within noise.  The VM-call column runs on TVM's copies of the inputs (64-byte aligned), run() on the numpy
arrays themselves, which an .npz load places 16-48 bytes past a 64-byte line.  This script holds the
values fixed and moves only the placement: the same input values copied into buffers that start at
``--offsets`` bytes past a 4096-byte page (0: 64-byte aligned; 16/32/48: the .npz's placements; 1024,
2048+32: another cache set, to tell alignment from 4K aliasing against the kernels' own buffers), and
times, per placement:

- ``vm@<offset>``: the VM's ``main`` on a DLPack view of that buffer (the kernels alone, no run());
- ``run@<offset>``: ``run()`` on that buffer (numpy in, numpy out);
- ``vm_tensor``: the VM call on ``C.tensor`` of the input (Table 3's VM-call column).

``--artifact``: the same for ``Runner.run`` of the model exported and loaded again.  ``--models``: the
``bench_cpu.py`` workloads (resnet_block by default).

Paths are timed in blocks of back-to-back calls, every path once per round, the order rotated each
round; clock (``--clock``): the calling thread's CPU time with ``TVM_NUM_THREADS=1`` (other processes'
load does not count in it, their cache and memory-bandwidth pressure does), else wall time, or the CPU
time of the whole process (``process``: the thread pool's workers too, their spin-waiting included).  Reported: each path's
median per-round ratio to ``vm@0`` (paired: the two blocks of a round share the load) with p25-p75.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = 4096

MODELS = {
    "resnet_block": (lambda: M.resnet_block(), 20),
    "conv3x3_bn_relu_res": (lambda: M.conv_bn_relu_residual(channels=64, size=56), 3),
    "layernorm": (lambda: M.layernorm(rows=512, d=768, decomposed=False), 20),
    "softmax": (lambda: M.softmax(rows=512, d=3072, decomposed=False), 5),
    "sigmoid_chain": (lambda: M.elementwise_chain(n=4 * 1024 * 1024), 2),
}


def placed(value: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``value`` whose data starts ``offset`` bytes past a page boundary (C-contiguous, writeable)."""
    raw = np.empty(value.nbytes + offset + PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE + offset
    out = raw[start:start + value.nbytes].view(value.dtype).reshape(value.shape)
    out[...] = value
    return out


def _block(fn, calls: int, clock) -> float:
    """Microseconds per call of ``calls`` back-to-back calls, after one untimed call (the block before ran
    on other memory: without it a block of a few calls of a memory-bound model counts one cold call)."""
    fn()
    t = clock()
    for _ in range(calls):
        fn()
    return (clock() - t) / calls / 1e3


def paths(m, feeds: dict, offsets: list) -> dict:
    f = m._main()
    out = {"vm_tensor": (lambda a=[C.tensor(feeds[s.name]) for s in m.inputs]: f(*a))}
    for off in offsets:
        at = {k: placed(v, off) for k, v in feeds.items()}
        views = [C.from_dlpack(at[s.name]) for s in m.inputs]
        out[f"vm@{off}"] = (lambda v=views: f(*v))
        out[f"run@{off}"] = (lambda a=at: m.run(a))
        out[f"_keep@{off}"] = at                      # the buffers stay alive with the closures
    return {k: v for k, v in out.items() if not k.startswith("_")}, out


def measure(m, feeds, offsets, calls, rounds, clock) -> dict:
    ps, keep = paths(m, feeds, offsets)
    names = list(ps)
    ref = m.run(feeds)
    for name, fn in ps.items():                        # warm-up, and every placement gives the same result
        for _ in range(3):
            r = fn()
        if name.startswith("run@"):
            for k, v in ref.items():
                np.testing.assert_allclose(r[k], v, rtol=1e-5, atol=1e-5)
    # where the VM's result tensors start in their page (the pool hands a few buffers out in turn): an input
    # at the same page offset as an output can make loads wait on stores to another address (4K aliasing)
    f = m._main()
    view0 = [C.from_dlpack(keep[f"_keep@{offsets[0]}"][s.name]) for s in m.inputs]
    out_offsets = sorted({_first_tensor(f(*view0)).data_ptr() % PAGE for _ in range(6)})
    per = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            per[n].append(_block(ps[n], calls, clock))
    base = np.array(per[f"vm@{offsets[0]}"])
    out = {}
    for n in names:
        v = np.array(per[n])
        ratio = v / base
        out[n] = {"median_us": float(np.median(v)), "ratio_to_vm@0": float(np.median(ratio)),
                  "ratio_p25": float(np.percentile(ratio, 25)), "ratio_p75": float(np.percentile(ratio, 75)),
                  "us": [float(x) for x in v]}
    # the placement effect on run(): run@k / run@0 paired
    r0 = np.array(per[f"run@{offsets[0]}"])
    for off in offsets[1:]:
        ratio = np.array(per[f"run@{off}"]) / r0
        out[f"run@{off}"]["ratio_to_run@0"] = float(np.median(ratio))
    del keep
    return {"output_page_offsets": out_offsets, "paths": out}


def _first_tensor(result):
    return result if isinstance(result, C.Tensor) else _first_tensor(result[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["resnet_block"], choices=list(MODELS))
    ap.add_argument("--offsets", type=int, nargs="*", default=[0, 16, 32, 48, 1024, 2080],
                    help="bytes past a page boundary; the first is the baseline (keep it 64-byte aligned)")
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--scale", type=float, default=1.0, help="calls per block: this times each model's default")
    ap.add_argument("--quick", action="store_true", help="7 rounds, a quarter of the calls")
    ap.add_argument("--clock", choices=("auto", "thread", "process", "wall"), default="auto",
                    help="auto: the calling thread's CPU time at TVM_NUM_THREADS=1, else wall time; process: "
                         "the CPU time of every thread (the pool's workers too, their spinning included)")
    ap.add_argument("--artifact", action="store_true",
                    help="time Runner.run of the exported artifact (tvmfuse.export + tvmfuse.load) instead")
    ap.add_argument("--json", default=os.path.join(HERE, "align_ab.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.scale = 7, 0.25
    if args.offsets[0] % 64:
        ap.error("the first offset is the aligned baseline: give a multiple of 64")
    threads = os.environ.get("TVM_NUM_THREADS")
    clocks = {"thread": (time.thread_time_ns, "thread CPU time"), "wall": (time.perf_counter_ns, "wall time"),
              "process": (time.process_time_ns, "process CPU time (all threads)")}
    clock, clock_name = clocks[args.clock if args.clock != "auto" else "thread" if threads == "1" else "wall"]
    print(f"TVM_NUM_THREADS={threads or '(default)'}, clock: {clock_name}, load average {os.getloadavg()}")
    rows = []
    for name in args.models:
        make, calls = MODELS[name]
        cm = tvmfuse.compile(make(), tuning_log=None)
        if args.artifact:
            cm = tvmfuse.load(tvmfuse.export(cm, tempfile.mkdtemp(prefix="align-ab-")))
        rng = np.random.default_rng(0)
        feeds = {s.name: rng.standard_normal(s.shape).astype(s.dtype) for s in cm.inputs}
        res = measure(cm, feeds, args.offsets, max(1, int(calls * args.scale)), args.rounds, clock)
        rows.append({"model": name, "kind": "artifact" if args.artifact else "compiled", **res})
        res = res["paths"]
        print(f"\n{name}{' (artifact)' if args.artifact else ''} ({args.rounds} rounds, load average now {os.getloadavg()[0]:.2f})")
        print(f"first output starts at page offset(s) {rows[-1]['output_page_offsets']}")
        print(f"{'path':12s} {'median us':>10s} {'/ vm@0 (paired)':>16s} {'p25-p75':>14s} {'/ run@0':>8s}")
        for p, d in res.items():
            extra = f"{d['ratio_to_run@0']:8.3f}" if "ratio_to_run@0" in d else ""
            print(f"{p:12s} {d['median_us']:10.1f} {d['ratio_to_vm@0']:16.3f} "
                  f"{d['ratio_p25']:6.3f}-{d['ratio_p75']:6.3f} {extra}")
    with open(args.json, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "command": " ".join(["python", os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
                   "warmup_call_per_block": True, "threads": threads, "clock": clock_name, "offsets": args.offsets, "rounds": args.rounds,
                   "load_average_end": os.getloadavg(), "rows": rows}, f, indent=1)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
