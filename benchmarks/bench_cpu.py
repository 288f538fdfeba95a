"""CPU benchmark: tvmfuse beside the baselines a TVM or onnxruntime user would pick, every output checked.

    python benchmarks/bench_cpu.py                      # table 1: engines x workloads -> benchmarks/bench_cpu.json
    python benchmarks/bench_cpu.py --ms-trials 64       # table 2: + TVM MetaSchedule -> benchmarks/bench_cpu_ms.json
    # table 2 in two steps: tune once (long; checks the build, times nothing), then time from the databases
    # (databases per CPU: benchmarks/ms_db/<mcpu>/<workload>/; session 8's Intel ones: ms_db/<workload>/)
    python benchmarks/bench_cpu.py --engines onnx_reference tvm_metaschedule --ms-trials 64 \
        --ms-work-dir benchmarks/ms_db/znver5 --repeat 0 --workloads qkv \
        --json benchmarks/ms_db/znver5/qkv.tuning_check.json
    python benchmarks/bench_cpu.py --ms-from-db      # from benchmarks/ms_db/<host mcpu>/ -> bench_cpu_ms.json
    # table 1, every engine in one run (torch_compile's worker under an interpreter with torch and onnx2torch)
    python benchmarks/bench_cpu.py --engines onnx_reference ort_default ort_nospin tvm_dlight tvm_metaschedule \
        torch_compile tvmfuse_separate tvmfuse --ms-from-db --torch-python /work/venv-corpus/bin/python \
        --json benchmarks/bench_cpu.json
    python benchmarks/bench_cpu.py --io                 # table 3: tvmfuse I/O paths  -> benchmarks/bench_cpu_io.json
    python benchmarks/bench_cpu.py --tails              # softmax rows with a tail vs padded -> bench_cpu_tails.json
    python benchmarks/bench_cpu.py --quick --repeat 3 --no-models    # smoke run (quarter-size workloads)

Engines (``--engines`` picks; ENGINES below says what each one is):

- ``onnx_reference``: onnx.reference.ReferenceEvaluator (numpy, one op at a time); also the outputs'
  reference for every engine's check.
- ``ort_default``: onnxruntime, default session options except ``intra_op_num_threads`` = ``--threads``.
- ``ort_nospin``: the same with idle workers told not to spin (``session.intra_op.allow_spinning=0``).
- ``tvm_dlight``: TVM's own fusion (LegalizeOps + FuseOps + FuseTIR), every kernel then scheduled by the
  CPU rules TVM 0.27 ships in ``tvm.s_tir.dlight.cpu`` (GEMV, Reduction; a kernel neither matches keeps
  TVM's default loop nest), then TVM's lowering.
- ``tvm_metaschedule``: ``relax.get_pipeline("static_shape_tuning", ...)`` then ``tvm.compile`` (TVM's
  documented CPU route, without ``cpu_weight_prepack``: it changes the model's calling interface).  Tuning
  (``--ms-trials N``: N trials per task, every task of the model: see _ms_tune) is the pipeline's
  MetaScheduleTuneIRMod step run explicitly, with build/run time limits a loaded host needs; the compile
  is always ``static_shape_tuning`` with total_trials=0 on the database folder, i.e. the same passes with
  MetaScheduleApplyDatabase(work_dir).  ``--ms-work-dir DIR`` keeps each workload's database in
  DIR/<workload>/ (MetaSchedule's own JSON files, plus MS_TUNING_INFO: budget, tuning time, machine, load
  average sampled through the tuning); ``--ms-from-db`` compiles from them without tuning, by default from
  ``benchmarks/ms_db/<host mcpu>/`` (MS_DB_ROOT; a database is only valid for the CPU it was tuned on).  A
  database whose records or tuning info name another target than the compile target (kind, triple, CPU,
  attributes, cores: MS_TARGET_KEYS) is refused with the differing fields, never silently applied.  The
  row records which database, its trial budget, its tuning time and load, and how many tasks had a record.
  Off unless ``--ms-trials N`` or ``--ms-from-db``.
- ``torch_compile``: ``torch.compile`` of the model converted by onnx2torch, when both import (else the
  row says why it was skipped); a model with an op form onnx2torch cannot convert is converted at
  TORCH_FALLBACK_OPSET first (onnx.version_converter; the row's ``onnx2torch_opset`` says so), else skipped
  with onnx2torch's reason; onnx2torch's Reshape modules with a constant shape are folded to a reshape to a
  tuple of ints first (``_fold_constant_reshapes``: dynamo cannot trace onnx2torch's, which builds
  ``torch.Size`` from a tensor; the row's ``onnx2torch_constant_reshapes`` counts them); a module
  torch.compile fails on (its first call) is skipped with that error.
  ``--torch-python PY`` runs its worker under another interpreter: this project's one is
  /work/venv-corpus (torch 2.13 CPU), where onnx2torch was installed with
  ``/work/venv-corpus/bin/pip install --no-deps onnx2torch==1.5.15`` (its dependencies numpy, onnx, torch,
  torchvision are there already; torchvision's compiled ops do not load with PyPI's CPU torch, see
  _TorchvisionPlaceholder).
- ``tvm_fuseops``: TVM's fusion with no schedule at all (what the old "stock TVM" column was; no user
  deploys it). Off by default: slow at full size.
- ``tvmfuse_separate``: no fusion, every op its own kernel scheduled by tvmfuse's templates.
- ``tvmfuse``: ``tvmfuse.compile(model, tuning_log=None)``: untuned target defaults.
- ``tvmfuse_shipped``: ``tuning_log="shipped"``: the records shipped in tuning_logs/ (off by default).
- ``--io`` adds, per workload (each engine's ``input_offsets`` in the JSON: where its inputs start, bytes
  past a 64-byte line; ``run_aligned/vm`` in ``io_paired`` pairs the two columns fed alike, 64-byte
  aligned; ``benchmarks/align_ab.py`` measures what the placement itself changes):
  the VM call on device tensors (TVM's 64-byte-aligned copies of the inputs),
  the VM call on DLPack views of the very numpy arrays ``run()`` gets (``*_vm_views``: the same kernels on
  the same memory, so run() / it is what run() itself adds), ``CompiledModel.run()`` with numpy in and
  out (numpy inputs made after the model is compiled, as a user's program makes them: 64-byte aligned
  since ``tvmfuse.io.aligned_numpy``, session 13; the same made with numpy's own allocator, 16 bytes past
  a line, ``*_run_numpy16``; and ``tvmfuse.empty`` inputs: all read in place since
  ``PipelineOptions.element_aligned_args``; before it numpy inputs were copied once), ``run()`` on numpy
  views of the VM call's own device tensors (``*_run_same``: ``run_same/vm`` differs from the VM call in
  nothing but run()'s steps: same input memory, same VM and output pool; io10) and the same four for
  ``Runner.run`` of the exported artifact (``tvmfuse.export`` + ``tvmfuse.load``).
- ``--tails`` (issue 11: a row the vector does not divide within 10% of a padded row): Softmax over rows
  of TAIL_ROWS elements (104, 1000, 3071: a scalar tail after the vector main loop on AVX-512, and on AVX2
  for 3071) against the same softmax over rows padded to a multiple of TAIL_PAD (112, 1008, 3072), each
  through ``run()`` on numpy and as the VM call on device tensors.  The padded engines feed the row
  padded with TAIL_PAD_VALUE (exp of it is 0, so the first d outputs are the unpadded softmax and are
  checked against the workload's reference like every engine's).

Method: each engine runs in its own worker process per workload (this file with ``--worker``): it builds
the engine, runs it once on the workload's inputs (an .npz written by this process) and writes its
outputs to an .npz, which this process checks against the ONNX reference (CHECK_RTOL, CHECK_ATOL).
Commands and replies are JSON lines on the worker's stdin/stdout; no pickle.  Then ``--repeat`` rounds:
in each round every engine, in turn (a fresh seeded order each round), times one block of back-to-back calls
about BLOCK_SECONDS long, with a ``--pause`` between engines so that one runtime's idle spinning workers
do not run into the next one's block (alternating single calls in one process made either engine up to
10x slower).  Each figure is the median over rounds of the block's seconds per call, with p25/p75 and
min/max.  ``--io`` and ``--tails`` run all their engines of one workload in one worker process (one compile
shared, timed interleaved on the same inputs, memory and thread pool; one runtime, so no other's spinning
workers): across processes the same call differed by 10-20% from one run to the next, as much as the
differences these tables are for.  Their ratios are also given paired round by round (``io_paired``,
``tail_paired``: the median of the per-round ratios of two engines timed back to back in the same round,
its p25-p75 and a bootstrap interval of that median, ``paired_ratio``): a load that slows both blocks of
a round cancels in their ratio, where each engine's own median moves with it.  Floors (a large copy for
memory-bound workloads, a large numpy matmul for compute-bound ones) are measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types

if os.environ.get(APPEND_PATH_ENV := "BENCH_CPU_APPEND_SITE"):   # a --torch-python worker: this project's
    import site                                                   # packages after the interpreter's own

    for _dir in os.environ[APPEND_PATH_ENV].split(os.pathsep):
        site.addsitedir(_dir)

import numpy as np
import onnx

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.target import configure_threads

HERE = os.path.dirname(os.path.abspath(__file__))
FLOOR_COPY_BYTES = 256 * 1024 * 1024 // 4 * 4     # the copy that measures DRAM bandwidth
FLOOR_MATMUL = 1024                               # the square matmul that measures float32 FLOP/s
BLOCK_SECONDS = 0.05   # each engine runs a block of calls this long per round (see _time)
BOOTSTRAP_RESAMPLES = 2000   # paired_ratio: resamples of the rounds for the interval of the median ratio
BOOTSTRAP_LEVEL = 0.9        # ... and that interval's coverage
MAX_BLOCK_CALLS = 200
ORDER_SEED = 0               # the engines' order in each round: a seeded shuffle (bench_workload)
# Output check against the float32 ONNX reference: |out - ref| <= CHECK_ATOL + CHECK_RTOL * |ref|.  Fused
# kernels reorder sums (K up to 768 here) and tvmfuse uses approximations of exp/erf (fast math).
CHECK_RTOL, CHECK_ATOL = 1e-3, 1e-4

# tvm_metaschedule (see _ms_tune): the database files MetaSchedule's JSONDatabase keeps in a work_dir, and
# the JSON this script writes beside them (what the tuning run was: budget, time, machine, load)
MS_DB_FILES = ("database_workload.json", "database_tuning_record.json")
MS_TUNING_INFO = "tuning_info.json"
MS_TRIALS_PER_ITER = 64        # TVM's tune_relax default: candidates measured per search iteration
MS_BUILD_TIMEOUT_S = 600       # per build; TVM's 30 s default timed every build out on a loaded 2-core host
MS_RUN_TIMEOUT_S = 120         # per measurement
MS_SEED = 0                    # the evolutionary search's seed (recorded with the database)
MS_DB_ROOT = os.path.join(HERE, "ms_db")   # --ms-from-db without --ms-work-dir: MS_DB_ROOT/<host mcpu>/<workload>/
MS_TARGET_KEYS = ("kind", "mtriple", "mcpu", "mattr", "num-cores")   # what a database's target must share
MS_LOAD_SAMPLE_S = 30          # the 1-min load average is sampled this often during a tuning run
# torch_compile: onnx2torch (1.5.15) has no converter for some opset-18 forms (ReduceMean-18 takes its axes
# as an input: transformer_block); such a model is converted to this opset by onnx.version_converter first
TORCH_FALLBACK_OPSET = 17
WORKER_EXIT_TIMEOUT_S = 300    # a worker's exit after quit (bench_models' took over 60 s under load 20); then killed
TORCH_WHY_CHARS = 600          # how much of torch.compile's error a skipped row keeps (its cause and user-code line)
LOADED_PER_CPU = 0.5           # a 1-min load average above this x CPUs marks the tuning as run under load

ENGINES = {
    "onnx_reference": "onnx ReferenceEvaluator (numpy, op by op)",
    "ort_default": "onnxruntime, default session options (intra-op threads = --threads)",
    "ort_nospin": "onnxruntime, idle workers not spinning",
    "tvm_dlight": "TVM FuseOps + s_tir.dlight CPU rules (GEMV, Reduction)",
    "tvm_metaschedule": "TVM static_shape_tuning (MetaSchedule), --ms-trials trials per task",
    "torch_compile": "torch.compile (onnx2torch)",
    "tvm_fuseops": "TVM FuseOps, no schedules",
    "tvmfuse_separate": "tvmfuse schedules, no fusion",
    "tvmfuse": "tvmfuse, untuned (tuning_log=None)",
    "tvmfuse_shipped": "tvmfuse, shipped records (tuning_log='shipped')",
}
DEFAULT_ENGINES = ["onnx_reference", "ort_default", "ort_nospin", "tvm_dlight", "torch_compile",
                   "tvmfuse_separate", "tvmfuse"]
IO_ENGINES = {f"io_{p}{e}": f"{'artifact ' if p else ''}{d}"
              for p in ("", "artifact_")
              for e, d in (("vm", "VM call, device tensors"),
                           ("vm_views", "VM call, DLPack views of the numpy inputs run() gets"),
                           ("run_numpy", "run(), numpy in/out (arrays made after the model, as a user's)"),
                           ("run_numpy16", "run(), numpy in/out, numpy's own allocator (16-byte aligned)"),
                           ("run_aligned", "run(), tvmfuse.empty inputs"),
                           ("run_same", "run(), numpy views of the VM call's own device tensors"))}


# --tails: softmax row lengths with a tail on some vector width, and the padding that removes it
TAIL_ROWS = (104, 1000, 3071)
TAIL_PAD = 16                  # float32 lanes of AVX-512 (a multiple of AVX2's and NEON's)
TAIL_PAD_VALUE = -1e30         # padding input: its exp underflows to 0 and the row's softmax is unchanged
TAIL_ENGINES = {"tail_vm": "VM call, device tensors, rows of d",
                "tail_run": "run(), numpy in/out, rows of d",
                "tail_padded_vm": f"VM call, device tensors, rows padded to a multiple of {TAIL_PAD}",
                "tail_padded_run": f"run(), numpy in/out, rows padded to a multiple of {TAIL_PAD}"}


def tail_workloads(quick: bool):
    """Softmax [rows, d] for each d in TAIL_ROWS (rows: as the softmax workload of ``workloads``)."""
    rows = 512 // (4 if quick else 1)
    return [(f"softmax_tail_{d}", M.softmax(rows=rows, d=d, decomposed=False), "memory", 2 * 4 * rows * d)
            for d in TAIL_ROWS]


def workloads(quick: bool, models: bool):
    s = 4 if quick else 1
    mm = (512 // s, 768 // s, 3072 // s)
    wl = [
        # name, model, kind (compute/memory/model), work (flops or bytes) for the floor
        ("matmul_bias_gelu", M.matmul_bias_gelu(m=mm[0], k=mm[1], n=mm[2]), "compute", 2 * mm[0] * mm[1] * mm[2]),
        ("conv3x3_bn_relu_res", M.conv_bn_relu_residual(channels=64 // s, size=56 // s), "compute",
         2 * (64 // s) ** 2 * 9 * (56 // s) ** 2),
        ("layernorm", M.layernorm(rows=512 // s, d=768, decomposed=False), "memory", 2 * 4 * 512 // s * 768),
        ("softmax", M.softmax(rows=512 // s, d=3072, decomposed=False), "memory", 2 * 4 * 512 // s * 3072),
        ("sigmoid_chain", M.elementwise_chain(n=4 * 1024 * 1024 // s), "memory", 4 * 4 * 4 * 1024 * 1024 // s),
        ("qkv", M.qkv_projection(seq=512 // s, hidden=768 // s), "compute", 3 * 2 * (512 // s) * (768 // s) ** 2),
    ]
    if models:
        wl += [("transformer_block", M.transformer_block(), "model", 0),
               ("resnet_block", M.resnet_block(), "model", 0)]
    return wl


def _time(fn, warmup=1):
    """Seconds per call over a block of back-to-back calls (about BLOCK_SECONDS long)."""
    for _ in range(warmup):
        fn()
    t = time.perf_counter()
    fn()
    one = time.perf_counter() - t
    n = max(1, min(MAX_BLOCK_CALLS, int(BLOCK_SECONDS / max(one, 1e-6))))
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


# ---------------------------------------------------------------- worker side: one engine, one workload

class Skipped(Exception):
    """The engine cannot run here (a package is missing): the row says why, the run goes on."""


def _as_arrays(res) -> list:
    """An engine's result (dict, list, tuple, TVM tensor or array) as a list of numpy arrays."""
    if isinstance(res, dict):
        return [np.asarray(v) for v in res.values()]
    if isinstance(res, (list, tuple)) or type(res).__name__ in ("Array", "ArrayObj"):
        return [a for r in res for a in _as_arrays(r)]
    if hasattr(res, "numpy"):
        out = res.detach().cpu().numpy() if hasattr(res, "detach") else res.numpy()
        return [np.asarray(out)]
    return [np.asarray(res)]


def _ort(model, feeds, threads, spin: bool):
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise Skipped(f"onnxruntime not installed ({e})") from e
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda: sess.run(None, feeds)


def _vm_call(ex, feeds):
    vm = C.VirtualMachine(ex, C.cpu())
    args = [C.tensor(v) for v in feeds.values()]
    f = vm["main"]
    return lambda: f(*args)


def _stages_module(model, target, stages_of, schedules=False):
    """Compile ``model`` with a pipeline made of ``stages_of(Stages)`` passes: without tvmfuse's fusion
    rules, and without its schedules and fast math unless ``schedules``."""
    from tvmfuse.pipeline import PipelineOptions, Stages

    opts = PipelineOptions(fusion=False) if schedules else PipelineOptions(fusion=False, schedules=False,
                                                                            fast_math=False)
    stages = Stages(target, opts)

    @C.module_pass(opt_level=0, name="bench.pipeline")
    def _p(mod, _ctx):
        with stages.target:
            return C.Sequential(stages_of(stages))(mod)

    return C.compile_module(tvmfuse.load_onnx(model), stages.target, _p)


def _dlight(stages):
    return stages.graph() + stages.dlight() + stages.lower()


def _separate(stages):
    """No fusion, each op its own kernel, each scheduled by tvmfuse (the fused-vs-separate baseline)."""
    return stages.unfused() + stages.schedule() + stages.lower()


def _ms_prefix():
    """The passes ``static_shape_tuning`` runs before its tuning step (relax/pipeline.py in TVM 0.27):
    the module MetaSchedule extracts its tasks from, and the one MetaScheduleApplyDatabase later sees."""
    rt = C.relax_transform
    return C.Sequential([rt.DecomposeOpsForInference(), rt.CanonicalizeBindings(), C.relax_get_pipeline("zero")])


def _ms_tasks(mod, target):
    with target:
        return C.meta_schedule.relax_integration.extract_tasks(_ms_prefix()(mod), target, {})


def _ms_db_files(db_dir):
    return [os.path.join(db_dir, f) for f in MS_DB_FILES]


def ms_default_work_dir(target) -> str:
    """--ms-from-db without --ms-work-dir: the databases tuned for this target's CPU, MS_DB_ROOT/<mcpu>."""
    mcpu = str(target.attrs.get("mcpu", "")) if "mcpu" in target.attrs else ""
    if not mcpu:
        raise ValueError(f"--ms-from-db: target {target} names no -mcpu, so no default database folder under "
                         f"{MS_DB_ROOT}; pass --ms-work-dir DIR")
    return os.path.join(MS_DB_ROOT, mcpu)


def _ms_target_fields(target) -> dict:
    """The MS_TARGET_KEYS of a target (a tvm Target, its JSON text, or the dict a tuning record stores);
    lists (mattr) as sorted tuples, numbers as int, absent keys left out."""
    if not isinstance(target, dict):
        target = json.loads(str(target))
    out = {}
    for k in MS_TARGET_KEYS:
        v = target.get(k)
        if v in (None, "", []):
            continue
        out[k] = tuple(sorted(str(x) for x in v)) if isinstance(v, (list, tuple)) else \
            int(v) if k == "num-cores" else str(v)
    return out


def _ms_check_target(db_dir, target) -> None:
    """Refuses a database tuned for another target than ``target`` (MetaScheduleApplyDatabase matches
    records by workload only, so it would apply another CPU's schedules silently): every tuning record's
    target and the tuning info's must agree with ``target`` on MS_TARGET_KEYS."""
    want = _ms_target_fields(target)
    seen = []
    info_path = os.path.join(db_dir, MS_TUNING_INFO)
    if os.path.exists(info_path):
        with open(info_path) as f:
            info_target = json.load(f).get("target")
        if info_target:
            seen.append((MS_TUNING_INFO, _ms_target_fields(json.loads(info_target))))
    with open(os.path.join(db_dir, "database_tuning_record.json")) as f:
        for i, line in enumerate(f):
            if line.strip():
                rec = json.loads(line)
                seen.append((f"tuning record {i + 1}", _ms_target_fields(rec[1][2])))
    for where, got in seen:
        if got != want:
            diff = {k: (got.get(k), want.get(k)) for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)}
            raise ValueError(
                f"MetaSchedule database in {db_dir} was tuned for another target ({where}: "
                + ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in diff.items())
                + f"); its schedules are not for this compile target ({target}). Use the database of this CPU "
                f"(--ms-work-dir {os.path.join(MS_DB_ROOT, str(want.get('mcpu', '<mcpu>')))}) or tune one with "
                "--ms-trials N --ms-work-dir DIR")


class _LoadSampler:
    """The 1-min load average every MS_LOAD_SAMPLE_S seconds while a tuning run lasts (a thread), so the
    tuning info says how loaded the machine was throughout, not only at the start and the end."""

    def __init__(self, every_s=MS_LOAD_SAMPLE_S):
        self.every_s, self.samples = every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ms-load-sampler", daemon=True)

    def _run(self):
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.every_s):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])
        return False

    def summary(self) -> dict:
        s = self.samples
        return {"tuning_load_avg_1min_samples": len(s), "tuning_load_avg_1min_every_s": self.every_s,
                "tuning_load_avg_1min_mean": statistics.fmean(s), "tuning_load_avg_1min_max": max(s),
                "tuning_load_avg_1min_min": min(s)}


def _ms_has_records(db_dir, tasks) -> list:
    """For each of ``tasks``: whether the database in ``db_dir`` holds a record for it (a task without one
    keeps TVM's default loop nest after MetaScheduleApplyDatabase)."""
    ms = C.meta_schedule
    db = ms.database.JSONDatabase(work_dir=db_dir, allow_missing=False)
    return [bool(db.has_workload(t.dispatched[0]) and db.get_top_k(db.commit_workload(t.dispatched[0]), 1))
            for t in tasks]


def _ms_records(db_dir, tasks) -> int:
    """How many of ``tasks`` the database in ``db_dir`` holds a record for."""
    return sum(_ms_has_records(db_dir, tasks))


def _ms_tune(mod, target, trials, db_dir, resume=False):
    """Tune every task of ``mod`` for ``trials`` trials into the JSON database in ``db_dir``: what
    ``static_shape_tuning``'s MetaScheduleTuneIRMod step does (TVM's ``tune_relax`` on the module after the
    same passes, params={}), with the total budget = trials x tasks and ``max_trials_per_task`` = trials, as
    the pipeline's docstring advises (else the first task takes the whole budget), and build/run time
    limits long enough for a loaded host (MS_BUILD_TIMEOUT_S, MS_RUN_TIMEOUT_S; TVM's 30 s default made
    builds time out under load).  Returns what the row records about the tuning.

    ``resume`` (--ms-resume): the database in ``db_dir`` is an interrupted tuning run's (its records, no
    MS_TUNING_INFO): only the tasks without a record are tuned, into the same database, each with the
    search seed it has in a whole run (the tune contexts of every task are made, in TVM's order, and only
    those without records are handed to the task scheduler; the XGBoost cost model starts again from this
    run's measurements).  The info says which tasks were kept and that the interrupted run's time and load
    are not in ``tuning_s``; a finished database (MS_TUNING_INFO present) is refused.  TVM's gradient task
    scheduler writes no record before every task was sent once (its round-robin pass; at trials per task =
    MS_TRIALS_PER_ITER that is the whole run): an interruption then leaves no records and resuming tunes
    every task; it saves time at budgets of several iterations per task (the issue's 1000 trials)."""
    ms = C.meta_schedule
    existing = [f for f in _ms_db_files(db_dir) if os.path.exists(f)]
    info_path = os.path.join(db_dir, MS_TUNING_INFO)
    if existing and not resume:
        raise ValueError(f"MetaSchedule database already in {db_dir} ({existing}): tuning would add to it; "
                         "delete it to retune, pass --ms-from-db to compile from it"
                         + ("" if os.path.exists(info_path) else
                            ", or --ms-resume to tune only its tasks without a record (an interrupted run)"))
    if resume and os.path.exists(info_path):
        raise ValueError(f"--ms-resume: the tuning in {db_dir} finished ({MS_TUNING_INFO} is there): nothing to "
                         "resume; pass --ms-from-db to compile from it")
    if resume and len(existing) != len(MS_DB_FILES) and existing:
        raise ValueError(f"--ms-resume: {db_dir} holds {existing} but not all of {list(MS_DB_FILES)}: not a "
                         "MetaSchedule database to resume; delete it to retune")
    os.makedirs(db_dir, exist_ok=True)
    tasks = _ms_tasks(mod, target)
    done = _ms_has_records(db_dir, tasks) if existing else [False] * len(tasks)
    todo = [i for i, d in enumerate(done) if not d]
    load_start, t0 = os.getloadavg(), time.perf_counter()
    with target, _LoadSampler() as load:
        if not resume:
            ms.relax_integration.tune_relax(
                _ms_prefix()(mod), {}, target, db_dir, max_trials_global=trials * len(tasks),
                max_trials_per_task=trials, num_trials_per_iter=min(MS_TRIALS_PER_ITER, trials),
                builder=ms.builder.LocalBuilder(timeout_sec=MS_BUILD_TIMEOUT_S),
                runner=ms.runner.LocalRunner(timeout_sec=MS_RUN_TIMEOUT_S), seed=MS_SEED)
        elif todo:     # tune_relax's steps, with only the tasks that have no record handed to the scheduler
            contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
                extracted_tasks=tasks, work_dir=db_dir, space="post-order-apply", strategy="evolutionary",
                seed=MS_SEED)
            ms.tune.tune_tasks(
                tasks=[contexts[i] for i in todo], task_weights=[weights[i] for i in todo], work_dir=db_dir,
                max_trials_global=trials * len(todo), max_trials_per_task=trials,
                num_trials_per_iter=min(MS_TRIALS_PER_ITER, trials),
                builder=ms.builder.LocalBuilder(timeout_sec=MS_BUILD_TIMEOUT_S),
                runner=ms.runner.LocalRunner(timeout_sec=MS_RUN_TIMEOUT_S), database="json",
                cost_model="xgb", measure_callbacks="default", task_scheduler="gradient",
                module_equality="structural")
    tuning_s = time.perf_counter() - t0
    load_end = os.getloadavg()
    info = {"database": os.path.relpath(db_dir, os.path.dirname(HERE)), "trials_per_task": trials,
            "tasks": len(tasks), "task_names": [t.task_name for t in tasks], "total_trials": trials * len(tasks),
            "tuning_s": tuning_s, "tuning_date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "tuning_cpu": C.llvm_system_cpu(), "tuning_cpus": os.cpu_count(), "target": str(target),
            "tvm": C.TVM_VERSION, "seed": MS_SEED,
            "tuning_load_avg_start": load_start, "tuning_load_avg_end": load_end, **load.summary(),
            "tuning_on_loaded_machine": max(load_start[0], load_end[0], *load.samples)
            > LOADED_PER_CPU * os.cpu_count()}
    if resume:
        info["resumed"] = {
            "tasks_kept": [tasks[i].task_name for i, d in enumerate(done) if d],
            "tasks_tuned": [tasks[i].task_name for i in todo],
            "note": "an interrupted run's records kept (--ms-resume); tuning_s and the load cover only "
                    "tasks_tuned: the interrupted run's time and load are not recorded here"}
    with open(info_path, "w") as f:
        json.dump(info, f, indent=1)
    return info


def _ms_info(db_dir, trials, target=None):
    """--ms-from-db: what the stored database's tuning run recorded (MS_TUNING_INFO beside it); with
    ``target``, refuses a database tuned for another one (_ms_check_target)."""
    missing = [f for f in _ms_db_files(db_dir) + [os.path.join(db_dir, MS_TUNING_INFO)] if not os.path.exists(f)]
    if missing and all(os.path.exists(f) for f in _ms_db_files(db_dir)):
        raise ValueError(f"--ms-from-db: the MetaSchedule tuning in {db_dir} did not finish (no {MS_TUNING_INFO}); "
                         f"tune its tasks without a record with --ms-trials N --ms-resume --ms-work-dir "
                         f"{os.path.dirname(db_dir)}")
    if missing:
        raise ValueError(f"--ms-from-db: no MetaSchedule database for this workload in {db_dir} (missing "
                         f"{missing}); tune it first with --ms-trials N --ms-work-dir {os.path.dirname(db_dir)}")
    with open(os.path.join(db_dir, MS_TUNING_INFO)) as f:
        info = json.load(f)
    if trials and trials != info["trials_per_task"]:
        raise ValueError(f"--ms-trials {trials} but the database in {db_dir} was tuned with "
                         f"{info['trials_per_task']} trials per task")
    if target is not None:
        _ms_check_target(db_dir, target)
    return info


def _metaschedule(model, target, trials, db_dir, from_db, resume=False):
    """TVM's documented CPU route: the static_shape_tuning pipeline, then tvm.compile.  Tunes into
    ``db_dir`` first unless ``from_db``; the compile is always ``static_shape_tuning`` with total_trials=0,
    i.e. the same passes with MetaScheduleApplyDatabase(db_dir) and no tuning."""
    mod = tvmfuse.load_onnx(model)
    info = _ms_info(db_dir, trials, target) if from_db else _ms_tune(mod, target, trials, db_dir, resume)
    info = {**info, "from_db": from_db, "tasks_with_records": _ms_records(db_dir, _ms_tasks(mod, target))}
    with target:
        mod = C.relax_get_pipeline("static_shape_tuning", total_trials=0, target=target, work_dir=db_dir)(mod)
    ex = C.compile_module(mod, target, "default")
    return ex, info


class _TorchvisionPlaceholder(types.ModuleType):
    """Stands in for a torchvision whose compiled ops do not load (PyPI's CPU torch with its torchvision
    wheel: ``RuntimeError: operator torchvision::nms does not exist``). onnx2torch imports torchvision only
    for NonMaxSuppression and RoiAlign, which no benchmark workload contains; calling any of its functions
    raises the cause."""

    def __init__(self, cause):
        super().__init__("torchvision")
        self.cause = cause

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cause = self.cause

        def unusable(*args, **kwargs):
            raise RuntimeError(f"torchvision is unusable here ({cause}); torchvision {name} was called")

        return unusable


def _import_onnx2torch():
    try:
        import torchvision  # noqa: F401
    except RuntimeError as e:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        placeholder = _TorchvisionPlaceholder(e)
        sys.modules["torchvision"] = placeholder
        sys.modules["torchvision.ops"] = placeholder
    import onnx2torch

    return onnx2torch


def _reshape_to_constant_shape(x, shape):
    """ONNX Reshape (allowzero=0, the only form onnx2torch converts) to a constant ``shape``, a tuple of
    Python ints: 0 copies the input's dim at that position, -1 is inferred by ``reshape``."""
    return x.reshape(tuple(x.shape[i] if d == 0 else d for i, d in enumerate(shape)))


def _constant_of(gm, node):
    """The tensor ``node`` of the torch.fx graph of ``gm`` always gives when it is a constant (an ONNX
    initializer, which onnx2torch makes a ``get_attr`` of a buffer, or the output of its ``OnnxConstant``
    module); else None."""
    if node.op == "get_attr":
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        return value
    if node.op == "call_module" and not node.args and not node.kwargs:
        module = gm.get_submodule(node.target)
        if type(module).__name__ == "OnnxConstant":
            return module.value
    return None


def _fold_constant_reshapes(gm):
    """torch.compile (dynamo) cannot trace onnx2torch's ``OnnxReshape``: it builds ``torch.Size(shape)``
    from the shape *tensor* (``TypeError: torch.Size() takes an iterable of 'int' (item 0 is
    'FakeTensor')``). Each OnnxReshape of the converted torch.fx GraphModule ``gm`` whose shape is a constant
    becomes a call of ``_reshape_to_constant_shape`` with that shape as a tuple of ints (the same result:
    ONNX Reshape's semantics); one with a computed shape is left as it is. Returns how many were folded."""
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or type(gm.get_submodule(node.target)).__name__ != "OnnxReshape":
            continue
        data, shape_node = node.args
        shape = _constant_of(gm, shape_node)
        if shape is None:
            continue
        if shape.dim() != 1 or shape.dtype.is_floating_point or shape.dtype.is_complex:
            raise ValueError(f"Reshape {node.target}: its constant shape must be a 1-D integer tensor, got "
                             f"{shape.dtype} of shape {tuple(shape.shape)}")
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(_reshape_to_constant_shape, (data, tuple(int(d) for d in shape.tolist())))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        folded += 1
    if folded:
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return folded


def _torch(model, feeds, threads):
    try:
        import torch

        onnx2torch = _import_onnx2torch()
    except ImportError as e:
        raise Skipped(f"torch.compile skipped: {e}") from e
    torch.set_num_threads(threads)
    info = {"torch": torch.__version__}
    try:
        module = onnx2torch.convert(model)
    except NotImplementedError as e:      # an op form onnx2torch has no converter for: try the older opset
        from onnx import version_converter

        try:
            module = onnx2torch.convert(version_converter.convert_version(model, TORCH_FALLBACK_OPSET))
        except NotImplementedError as e2:
            raise Skipped(f"torch.compile skipped: onnx2torch cannot convert the model ({e}), nor at opset "
                          f"{TORCH_FALLBACK_OPSET} ({e2})") from e2
        info.update(onnx2torch_opset=TORCH_FALLBACK_OPSET,
                    onnx2torch_why=f"converted at opset {TORCH_FALLBACK_OPSET} (onnx.version_converter): {e}")
    folded = _fold_constant_reshapes(module)
    if folded:
        info["onnx2torch_constant_reshapes"] = folded     # how many OnnxReshape modules were folded
    net = torch.compile(module.eval())
    args = [torch.from_numpy(v) for v in feeds.values()]

    def run():
        with torch.inference_mode():
            return net(*args)

    try:      # torch.compile compiles on the first call: a module it cannot compile fails here
        run()
    except Exception as e:  # noqa: BLE001  the row says why (dynamo/inductor raise many types)
        why = " ".join(str(e).split())[:TORCH_WHY_CHARS]
        raise Skipped(f"torch.compile failed on the onnx2torch module ({info.get('onnx2torch_why', 'as converted')}): "
                      f"{type(e).__name__}: {why}") from e
    run.info = info
    return run


_BUILT: dict = {}     # --io and --tails: what the engines of one worker share (one compile, one artifact)


def _io(kind, model, feeds, work_dir):
    if "compiled" not in _BUILT:
        _BUILT["compiled"] = tvmfuse.compile(model, tuning_log=None)
    cm = _BUILT["compiled"]
    if "artifact" in kind and "artifact" not in _BUILT:
        _BUILT["artifact"] = tvmfuse.load(tvmfuse.export(cm, os.path.join(work_dir, "artifact")))
    m = _BUILT["artifact"] if "artifact" in kind else cm
    # the VM call's device tensors (TVM's copies, 64-byte aligned), made once per model: ``*_run_same``
    # gives run() numpy views of these very tensors, so that pair differs in nothing but run()'s own steps
    key = ("device_args", "artifact" in kind)
    if key not in _BUILT:
        _BUILT[key] = [C.tensor(feeds[s.name]) for s in m.inputs]
    # the numpy inputs a user's program makes once the model is compiled or loaded: with numpy's allocator
    # as tvmfuse leaves it (64-byte aligned since tvmfuse.io.aligned_numpy, unless TVMFUSE_ALIGNED_NUMPY=0);
    # ``*_run_numpy16`` gets copies made with numpy's own allocator (16-byte aligned) for comparison
    np_key = ("numpy_inputs", "artifact" in kind)
    if np_key not in _BUILT:
        _BUILT[np_key] = {k: v.copy() for k, v in feeds.items()}
        was_aligned = tvmfuse.io.numpy_allocator() == tvmfuse.io.ALIGNED_HANDLER_NAME
        tvmfuse.io.aligned_numpy(False)
        try:
            _BUILT[np_key + ("16",)] = {k: v.copy() for k, v in feeds.items()}
        finally:
            tvmfuse.io.aligned_numpy(was_aligned)
    user_inputs = _BUILT[np_key]
    if kind.endswith("_vm") or kind.endswith("_vm_views"):
        # device tensors: TVM's copies (64-byte aligned); views: the very arrays run() is given
        args = _BUILT[key] if kind.endswith("_vm") else [C.from_dlpack(user_inputs[s.name]) for s in m.inputs]
        f = m._main()
        fn = lambda: f(*args)                                  # noqa: E731
        fn.info = {"input_offsets": _offsets({s.name: a.data_ptr() for s, a in zip(m.inputs, args)})}
        return fn
    if kind.endswith("run_numpy"):
        given = user_inputs
    elif kind.endswith("run_numpy16"):
        given = _BUILT[np_key + ("16",)]
    elif kind.endswith("run_same"):
        given = {s.name: np.from_dlpack(t) for s, t in zip(m.inputs, _BUILT[key])}
    else:
        given = {}
        for k, v in feeds.items():
            given[k] = tvmfuse.empty(v.shape, v.dtype)
            given[k][...] = v
    fn = lambda: m.run(given)                                  # noqa: E731
    fn.info = {"input_offsets": _offsets({k: v.ctypes.data for k, v in given.items()})}
    return fn


def _offsets(ptrs: dict) -> dict:
    """--io: where each engine's inputs start: {input: bytes past a 64-byte line} (what a fair comparison
    states it feeds each column; ``benchmarks/align_ab.py`` measures what it changes: nothing measurable
    on resnet_block, softmax 4-6% slower and layernorm 4-8% faster off a line, benchmarks/notes/io8.md)."""
    return {k: int(p) % 64 for k, p in ptrs.items()}


def _tail(kind, model, feeds):
    """A ``--tails`` engine: softmax over the workload's rows (``tail_*``) or over the rows padded to a
    multiple of TAIL_PAD (``tail_padded_*``); the callable's ``check_outputs`` gives the outputs to check
    (the padded engine's first d columns)."""
    (_, x), = feeds.items()
    rows, d = x.shape
    if "padded" in kind:
        width = -(-d // TAIL_PAD) * TAIL_PAD
        model = M.softmax(rows=rows, d=width, decomposed=False)
        x = np.concatenate([x, np.full((rows, width - d), TAIL_PAD_VALUE, x.dtype)], axis=1)
    key = "tail_padded" if "padded" in kind else "tail"
    if key not in _BUILT:
        _BUILT[key] = tvmfuse.compile(model, tuning_log=None)
    cm = _BUILT[key]
    feeds = {cm.inputs[0].name: np.ascontiguousarray(x)}
    if kind.endswith("_vm"):
        args = [C.tensor(feeds[cm.inputs[0].name])]
        f = cm._main()
        fn = lambda: f(*args)                                  # noqa: E731
    else:
        fn = lambda: cm.run(feeds)                             # noqa: E731
    fn.check_outputs = lambda res: [a[:, :d] for a in _as_arrays(res)]
    return fn


def build_engine(engine, model, feeds, threads, ms, work_dir):
    """The callable that runs ``engine`` once on ``feeds`` (inputs prepared outside the call); ``ms``:
    tvm_metaschedule's settings (trials per task, database folder, from_db).  A callable may carry
    ``info`` (a dict the row records) and ``check_outputs``."""
    target = tvmfuse.host_target()
    if engine == "onnx_reference":
        from onnx.reference import ReferenceEvaluator

        ev = ReferenceEvaluator(model)
        return lambda: ev.run(None, feeds)
    if engine in ("ort_default", "ort_nospin"):
        return _ort(model, feeds, threads, spin=engine == "ort_default")
    if engine == "torch_compile":
        return _torch(model, feeds, threads)
    configure_threads(threads)
    fn = _build_tvm_engine(engine, model, feeds, ms, work_dir, target)
    # again after the build: tvmfuse.compile (and export's load) size the pool to its own num_threads
    # argument, by default the physical cores, so before this a --threads 1 run timed tvmfuse on 2 threads
    # (conv12: conv3x3_bn_relu_res 1.42 ms "one thread", above one Zen 3 core's FMA peak)
    configure_threads(threads)
    return fn


def _build_tvm_engine(engine, model, feeds, ms, work_dir, target):
    """build_engine's TVM engines (the thread pool is sized by the caller)."""
    if engine == "tvm_dlight":
        return _vm_call(_stages_module(model, target, _dlight), feeds)
    if engine == "tvm_fuseops":
        return _vm_call(_stages_module(model, target, lambda st: st.graph() + st.lower()), feeds)
    if engine == "tvmfuse_separate":
        return _vm_call(_stages_module(model, target, _separate, schedules=True), feeds)
    if engine == "tvm_metaschedule":
        ex, info = _metaschedule(model, target, ms["trials"], ms["db_dir"], ms["from_db"], ms.get("resume", False))
        fn = _vm_call(ex, feeds)
        fn.info = {"metaschedule": info}
        return fn
    if engine in ("tvmfuse", "tvmfuse_shipped"):
        cm = tvmfuse.compile(model, tuning_log="shipped" if engine == "tvmfuse_shipped" else None)
        args = [C.tensor(feeds[s.name]) for s in cm.inputs]
        f = cm._main()
        return lambda: f(*args)
    if engine in IO_ENGINES:
        return _io(engine, model, feeds, work_dir)
    if engine in TAIL_ENGINES:
        return _tail(engine, model, feeds)
    raise ValueError(f"unknown engine {engine!r}; known: {sorted(ENGINES) + sorted(IO_ENGINES) + sorted(TAIL_ENGINES)}")


def worker(spec_path: str) -> int:
    """Build the engine(s) of one workload, write their outputs, then time blocks on request.

    ``spec["engines"]`` (--io, --tails): several engines in this one process, timed interleaved on the
    same inputs, memory and thread pool (each command names the engine); else ``spec["engine"]``."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)     # replies only; anything printed goes to stderr
    os.dup2(2, 1)

    def reply(d):
        proto.write(json.dumps(d) + "\n")

    with open(spec_path) as f:
        spec = json.load(f)
    model = onnx.load(spec["model"])
    with np.load(spec["feeds"]) as z:
        feeds = {k: z[k] for k in z.files}
    names = spec.get("engines") or [spec["engine"]]
    fns, built = {}, {}
    for e in names:
        t0 = time.perf_counter()
        try:
            fn = build_engine(e, model, feeds, spec["threads"], spec["ms"], spec["work_dir"])
        except Skipped as err:
            built[e] = {"ok": False, "skipped": str(err)}
            continue
        build_s = time.perf_counter() - t0
        outs = getattr(fn, "check_outputs", _as_arrays)(fn())
        np.savez(spec["outputs"] if "engine" in spec else spec["outputs"][e],
                 **{f"out{i}": a for i, a in enumerate(outs)})
        built[e] = {"ok": True, "build_s": build_s, "n_outputs": len(outs), **getattr(fn, "info", {})}
        del outs          # a result kept would hold one of the VM pool's buffers while the others are timed
        fns[e] = fn
    reply(built[names[0]] if "engine" in spec else {"ok": True, "engines": built})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        reply({"s": _time(fns[cmd.get("engine", names[0])])})
    return 0


# ---------------------------------------------------------------- parent side

class Worker:
    """One worker process: of one engine (``engine`` a name) or of several (a list: --io, --tails)."""

    def __init__(self, engine, workload, paths, args, work_dir):
        self.engine, self.workload = engine, workload
        group = not isinstance(engine, str)
        tag = "group" if group else engine
        spec = {"model": paths["model"], "feeds": paths["feeds"], "threads": args.threads,
                "ms": {"trials": args.ms_trials, "from_db": args.ms_from_db,
                       "resume": getattr(args, "ms_resume", False),
                       "db_dir": os.path.join(args.ms_work_dir, workload) if args.ms_work_dir
                       else os.path.join(work_dir, "ms")},
                "work_dir": work_dir}
        if group:
            spec.update(engines=list(engine), outputs={e: os.path.join(work_dir, f"{e}.out.npz") for e in engine})
        else:
            spec.update(engine=engine, outputs=os.path.join(work_dir, f"{engine}.out.npz"))
        self.outputs = spec["outputs"]
        spec_path = os.path.join(work_dir, f"{tag}.spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        self.log_path = os.path.join(work_dir, f"{tag}.log")
        self.log = open(self.log_path, "w")
        python, env = sys.executable, None
        if engine == "torch_compile" and getattr(args, "torch_python", None):
            # torch (and onnx2torch) from that interpreter, then this one's packages (TVM, tvmfuse, onnx)
            import site

            python = args.torch_python
            env = {**os.environ, APPEND_PATH_ENV: os.pathsep.join(site.getsitepackages())}
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--worker", spec_path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     bufsize=1, env=env)

    def ask(self, cmd=None):
        if cmd is not None:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.flush()
            with open(self.log_path) as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"{self.engine} worker for {self.workload} exited ({self.proc.returncode}): {tail}")
        return json.loads(line)

    def close(self):
        """Ask the worker to quit; one still running WORKER_EXIT_TIMEOUT_S later (its results are in) is
        killed with a line on stderr instead of failing the run."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=WORKER_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"  {self.engine} worker for {self.workload} (pid {self.proc.pid}) still running "
                      f"{WORKER_EXIT_TIMEOUT_S} s after quit: killed", file=sys.stderr, flush=True)
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Member:
    """One engine of a group worker: ``ask`` names it in each command."""

    def __init__(self, worker: Worker, engine: str):
        self.worker, self.engine, self.outputs = worker, engine, worker.outputs[engine]

    def ask(self, cmd):
        return self.worker.ask({**cmd, "engine": self.engine})


def check_outputs(path, ref: list) -> dict:
    with np.load(path) as z:
        outs = [z[f"out{i}"] for i in range(len(z.files))]
    if len(outs) != len(ref):
        return {"check": "FAIL", "why": f"{len(outs)} outputs, reference has {len(ref)}"}
    errs, ok = [], True
    for o, r in zip(outs, ref):
        if o.shape != r.shape:
            return {"check": "FAIL", "why": f"shape {o.shape} vs reference {r.shape}"}
        d = np.abs(o.astype(np.float64) - r.astype(np.float64))
        errs.append(float(d.max()) if d.size else 0.0)
        ok &= bool(np.all(d <= CHECK_ATOL + CHECK_RTOL * np.abs(r.astype(np.float64))))
    return {"check": "pass" if ok else "FAIL", "max_abs_error": max(errs)}


def floors():
    """Roofline numbers of this run: DRAM copy bandwidth (B/s) and matmul FLOP/s (numpy/BLAS)."""
    a = np.ones(FLOOR_COPY_BYTES // 4, np.float32)
    b = np.empty_like(a)
    bw = 2 * a.nbytes / min(_time(lambda: np.copyto(b, a)) for _ in range(5))
    x = np.random.default_rng(0).standard_normal((FLOOR_MATMUL, FLOOR_MATMUL)).astype(np.float32)
    flops = 2 * FLOOR_MATMUL ** 3 / min(_time(lambda: x @ x) for _ in range(5))
    return {"copy_GBps": bw / 1e9, "matmul_GFLOPs": flops / 1e9}


def _spread(ts):
    by_round = [t * 1e3 for t in ts]
    ms = sorted(by_round)
    q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else [ms[0]] * 3
    return {"median": statistics.median(ms), "p25": q[0], "p75": q[2], "min": ms[0], "max": ms[-1], "rounds": ms,
            "by_round": by_round}


def paired_ratio(num: list, den: list, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict | None:
    """The ratio of two engines timed in the same rounds (``by_round`` of ``_spread``), round by round:
    each round's two blocks ran back to back in one process on the same inputs, so the load that moves
    both (another process, the clock) cancels in their ratio, which the ratio of two medians keeps
    (issue 11: each path's own p25-p75 spans 10-20%, the target is 5%).  Returns the median of the
    per-round ratios, their p25/p75, and a bootstrap interval of that median (``BOOTSTRAP_LEVEL``, the
    rounds resampled ``resamples`` times with a fixed seed); None when the rounds do not pair up."""
    if not num or len(num) != len(den) or min(den) <= 0:
        return None
    r = np.array(num, dtype=np.float64) / np.array(den, dtype=np.float64)
    rng = np.random.default_rng(seed)
    meds = np.median(r[rng.integers(0, len(r), size=(resamples, len(r)))], axis=1)
    tail = (1 - BOOTSTRAP_LEVEL) / 2
    return {"median": float(np.median(r)), "p25": float(np.percentile(r, 25)), "p75": float(np.percentile(r, 75)),
            "ci": [float(np.quantile(meds, tail)), float(np.quantile(meds, 1 - tail))], "level": BOOTSTRAP_LEVEL,
            "rounds": len(r), "by_round": r.tolist()}


def paired_ratios(rows: list, pairs: dict) -> dict:
    """``paired_ratio`` per workload for each of ``pairs`` ({label: (engine, baseline engine)}); None
    where one of the two did not run."""
    out = {}
    for row in rows:
        rounds = {e: d["ms"].get("by_round") for e, d in row["engines"].items() if "ms" in d}
        out[row["workload"]] = {k: (paired_ratio(rounds[a], rounds[b]) if rounds.get(a) and rounds.get(b) else None)
                                for k, (a, b) in pairs.items()}
    return out


# --io: run() on numpy against the VM call, paired round by round (paired_ratio)
# (and run() on tvmfuse.empty inputs against the VM call: both 64-byte aligned, the pair placed alike)
# (and run() on numpy views of the VM call's own device tensors: the same memory, in and out, io10)
IO_PAIRS = {**{f"{p}run/{v}": (f"io_{p}run_numpy", f"io_{p}{v}") for p in ("", "artifact_") for v in ("vm", "vm_views")},
            **{f"{p}run_aligned/vm": (f"io_{p}run_aligned", f"io_{p}vm") for p in ("", "artifact_")},
            **{f"{p}run_numpy16/vm": (f"io_{p}run_numpy16", f"io_{p}vm") for p in ("", "artifact_")},
            **{f"{p}run_same/vm": (f"io_{p}run_same", f"io_{p}vm") for p in ("", "artifact_")}}
# --tails: rows of d against rows padded to TAIL_PAD, for the VM call and run()
TAIL_PAIRS = {k: (f"tail_{k}", f"tail_padded_{k}") for k in ("vm", "run")}


def bench_workload(name, model, engines, args, root):
    """Start one worker per engine, check every output, then time the engines in interleaved rounds."""
    work_dir = os.path.join(root, name)
    os.makedirs(work_dir)
    feeds = {k: np.random.default_rng(0).standard_normal(v.shape).astype(v.dtype)
             for k, v in M.random_feeds(model).items()}
    paths = {"model": os.path.join(work_dir, "model.onnx"), "feeds": os.path.join(work_dir, "feeds.npz")}
    onnx.save(model, paths["model"])
    np.savez(paths["feeds"], **feeds)
    ref = list(M.reference_outputs(model, feeds).values())
    result, live, procs = {}, {}, []
    try:
        if args.io or args.tails:
            # every I/O path of the workload in one process: the same inputs, memory and thread pool, timed
            # interleaved (across processes the same call differed by 10-20% run to run, issue 11)
            w = Worker(list(engines), name, paths, args, work_dir)
            procs.append(w)
            try:
                ready = w.ask()["engines"]
            except RuntimeError as err:
                return {e: {"error": str(err)} for e in engines}
            for e in engines:
                if not ready[e]["ok"]:
                    result[e] = {"skipped": ready[e]["skipped"]}
                    continue
                extra = {k: v for k, v in ready[e].items() if k not in ("ok", "build_s", "n_outputs")}
                result[e] = {"build_s": ready[e]["build_s"], **check_outputs(w.outputs[e], ref), **extra}
                print(f"  {name} {e}: built in {ready[e]['build_s']:.1f} s, check {result[e]['check']}", flush=True)
                live[e] = Member(w, e)
        for e in ([] if args.io or args.tails else engines):
            w = Worker(e, name, paths, args, work_dir)
            try:
                ready = w.ask()
            except RuntimeError as err:
                result[e] = {"error": str(err)}
                w.close()
                print(f"  {name} {e}: ERROR (see JSON)", flush=True)
                continue
            if not ready["ok"]:
                result[e] = {"skipped": ready["skipped"]}
                w.close()
                continue
            extra = {k: v for k, v in ready.items() if k not in ("ok", "build_s", "n_outputs")}
            result[e] = {"build_s": ready["build_s"], **check_outputs(w.outputs, ref), **extra}
            print(f"  {name} {e}: built in {ready['build_s']:.1f} s, check {result[e]['check']}", flush=True)
            live[e] = w
            procs.append(w)
        times = {e: [] for e in live}
        order = list(live)
        shuffle = random.Random(ORDER_SEED).shuffle
        for r in range(args.repeat):
            # a fresh order each round (seeded): a rotation keeps every engine right after the same other
            # one (io10: in --io that put run() after the VM on the same arrays in every round but one)
            shuffle(order)
            for e in list(order):
                times[e].append(live[e].ask({"cmd": "time"})["s"])
                time.sleep(args.pause)
        for e, ts in times.items():
            if ts:                                   # --repeat 0: built and checked, not timed
                result[e]["ms"] = _spread(ts)
    finally:
        for w in procs:
            w.close()
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="quarter-size workloads")
    ap.add_argument("--repeat", type=int, default=15, help="interleaved rounds (0: build and check only)")
    ap.add_argument("--pause", type=float, default=0.2, help="seconds between two engines' blocks")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", nargs="+", default=None, choices=list(ENGINES),
                    help=f"default: {' '.join(DEFAULT_ENGINES)} (+ tvm_metaschedule with --ms-trials)")
    ap.add_argument("--ms-trials", type=int, default=0,
                    help="run TVM MetaSchedule (static_shape_tuning) with this many trials per task, every task of "
                    "the model (0: off)")
    ap.add_argument("--ms-work-dir", default=None,
                    help="tvm_metaschedule: keep MetaSchedule's JSON database per workload in DIR/<workload>/ "
                    f"({', '.join(MS_DB_FILES)}, {MS_TUNING_INFO}); tuning refuses a workload that has one "
                    "(default: a temporary folder, thrown away; with --ms-from-db: MS_DB_ROOT/<host mcpu>, "
                    "e.g. benchmarks/ms_db/znver5)")
    ap.add_argument("--ms-from-db", action="store_true",
                    help="tvm_metaschedule: no tuning, compile from the databases in --ms-work-dir (static_shape_"
                    "tuning with total_trials=0: MetaScheduleApplyDatabase); a database tuned for another target "
                    "(CPU, triple, attributes, cores) is refused")
    ap.add_argument("--ms-resume", action="store_true",
                    help="with --ms-trials N --ms-work-dir DIR: a workload whose tuning was interrupted (its database "
                    f"in DIR/<workload>/ without {MS_TUNING_INFO}) tunes only its tasks without a record, into the "
                    "same database; a workload without a database is tuned whole; a finished one is refused. TVM "
                    "writes records only after every task got its first iteration: at 64 trials per task an "
                    "interrupted run has none")
    ap.add_argument("--workloads", nargs="+", default=None, help="only these workloads (names as printed)")
    ap.add_argument("--torch-python", default=None,
                    help="torch_compile: run its worker with this interpreter (one with torch and onnx2torch, e.g. "
                    "/work/venv-corpus/bin/python after `/work/venv-corpus/bin/pip install --no-deps "
                    "onnx2torch==1.5.15` there), this interpreter's "
                    "packages (TVM, tvmfuse, onnx) appended to its path; the same Python minor version and numpy "
                    "are needed (default: this interpreter)")
    ap.add_argument("--json", default=None, help="default: benchmarks/bench_cpu[_ms|_io].json")
    ap.add_argument("--no-models", action="store_true", help="skip the demo models end to end")
    ap.add_argument("--io", action="store_true", help="time tvmfuse's I/O paths (VM call, run() numpy, run() "
                    "aligned; compiled and exported) instead of the engines")
    ap.add_argument("--tails", action="store_true", help=f"time softmax over rows of {TAIL_ROWS} elements "
                    f"against rows padded to a multiple of {TAIL_PAD} (VM call and run()) instead of the engines")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.io and args.tails:
        ap.error("--io and --tails are two separate tables: give one")
    if args.io:
        engines = list(IO_ENGINES)
    elif args.tails:
        engines = list(TAIL_ENGINES)
    else:
        engines = list(args.engines or DEFAULT_ENGINES)
        if (args.ms_trials > 0 or args.ms_from_db) and "tvm_metaschedule" not in engines:
            engines.insert(engines.index("tvmfuse_separate") if "tvmfuse_separate" in engines else len(engines),
                           "tvm_metaschedule")
        if args.ms_from_db and not args.ms_work_dir:
            try:
                args.ms_work_dir = ms_default_work_dir(tvmfuse.host_target())
            except ValueError as e:
                ap.error(str(e))
            if not os.path.isdir(args.ms_work_dir):
                ap.error(f"--ms-from-db: no MetaSchedule databases for this CPU in {args.ms_work_dir}; tune them "
                         f"(--ms-trials N --ms-work-dir {os.path.relpath(args.ms_work_dir)}) or pass --ms-work-dir DIR")
        if args.ms_work_dir:
            args.ms_work_dir = os.path.abspath(args.ms_work_dir)
        if "tvm_metaschedule" in engines and args.ms_trials <= 0 and not args.ms_from_db:
            ap.error("tvm_metaschedule needs --ms-trials N (N > 0) or --ms-from-db")
        if args.ms_resume and (args.ms_trials <= 0 or args.ms_from_db or not args.ms_work_dir):
            ap.error("--ms-resume goes with --ms-trials N and --ms-work-dir DIR (the folder of the interrupted "
                     "tuning), not with --ms-from-db")
    out_json = args.json or os.path.join(HERE, "bench_cpu_io.json" if args.io else "bench_cpu_tails.json"
                                         if args.tails else "bench_cpu_ms.json" if args.ms_trials > 0 or args.ms_from_db
                                         else "bench_cpu.json")
    fl = floors()
    wl = tail_workloads(args.quick) if args.tails else workloads(args.quick, not args.no_models)
    if args.workloads:
        unknown = set(args.workloads) - {w[0] for w in wl}
        if unknown:
            ap.error(f"unknown workloads {sorted(unknown)}; known: {[w[0] for w in wl]}")
        wl = [w for w in wl if w[0] in args.workloads]
    root = tempfile.mkdtemp(prefix="bench-cpu-")
    load_start = os.getloadavg()
    rows = []
    for name, model, kind, work in wl:
        print(f"== {name}", flush=True)
        res = bench_workload(name, model, engines, args, root)
        floor_ms = (work / (fl["matmul_GFLOPs"] * 1e9) if kind == "compute" else
                    work / (fl["copy_GBps"] * 1e9) if kind == "memory" else float("nan")) * 1e3
        rows.append({"workload": name, "kind": kind, "floor_ms": floor_ms if floor_ms == floor_ms else None,
                     "engines": res})
    desc = {**ENGINES, **IO_ENGINES, **TAIL_ENGINES}
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": platform.processor() or platform.machine(), "cpu": C.llvm_system_cpu(),
           "cpus": os.cpu_count(), "threads": args.threads, "load_avg_start": load_start,
           "load_avg_end": os.getloadavg(), "repeat": args.repeat, "pause_s": args.pause,
           "block_s": BLOCK_SECONDS, "ms_trials": args.ms_trials, "ms_work_dir": args.ms_work_dir,
           "ms_from_db": args.ms_from_db, "ms_resume": args.ms_resume, "quick": args.quick,
           "torch_python": args.torch_python,
           "check": {"rtol": CHECK_RTOL, "atol": CHECK_ATOL, "reference": "onnx.reference.ReferenceEvaluator"},
           "command": " ".join(["python", os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
           "engines": {e: desc[e] for e in engines}, "floors": fl, "rows": rows}
    if args.tails:
        out["tail_ratios"] = tail_ratios(rows)
        out["tail_paired"] = paired_ratios(rows, TAIL_PAIRS)
    if args.io:
        out["io_ratios"] = io_ratios(rows)
        out["io_paired"] = paired_ratios(rows, IO_PAIRS)
    with open(out_json, "w") as f:
        json.dump(out, f, indent=1)
    print_table(out)
    if args.tails:
        print("\n| workload | VM call: rows of d / padded rows | run(): rows of d / padded rows |\n|---|---:|---:|")
        for name, r in out["tail_ratios"].items():
            print(f"| {name} | " + " | ".join("-" if r[k] is None else f"{r[k]:.2f}" for k in ("vm", "run")) + " |")
    if args.io:
        print("\n| workload | run() / VM call | run() / VM on views | artifact run / VM | artifact run / VM on views |"
              "\n|---|---:|---:|---:|---:|")
        for name, r in out["io_ratios"].items():
            print(f"| {name} | " + " | ".join("-" if r[k] is None else f"{r[k]:.2f}" for k in r) + " |")
        print("\ninputs' start, bytes past a 64-byte line (VM call / VM on views and run() numpy / run() "
              "tvmfuse.empty):")
        for r in rows:
            offs = {e: d.get("input_offsets") for e, d in r["engines"].items() if d.get("input_offsets")}
            print(f"  {r['workload']}: " + ", ".join(f"{e} {sorted(set(o.values()))}" for e, o in offs.items()))
    for key, cols in (("io_paired", IO_PAIRS), ("tail_paired", TAIL_PAIRS)):
        if key not in out:
            continue
        print(f"\npaired per round: median ratio [{BOOTSTRAP_LEVEL:.0%} bootstrap interval of it] (p25-p75)")
        print("| workload | " + " | ".join(cols) + " |\n|---|" + "---:|" * len(cols))
        for name, r in out[key].items():
            print(f"| {name} | " + " | ".join("-" if r[k] is None else f"{r[k]['median']:.3f} [{r[k]['ci'][0]:.3f}-"
                                               f"{r[k]['ci'][1]:.3f}] ({r[k]['p25']:.2f}-{r[k]['p75']:.2f})"
                                               for k in cols) + " |")
    print(f"wrote {out_json}")
    return 0


def io_ratios(rows: list) -> dict:
    """--io: per workload, median time of run() on numpy / median time of the VM call (on device tensors,
    and on DLPack views of the same numpy inputs), compiled and exported (None where one did not run)."""
    out = {}
    for r in rows:
        ms = {e: d["ms"]["median"] for e, d in r["engines"].items() if "ms" in d}
        out[r["workload"]] = {f"{p}run/{v}": (ms[f"io_{p}run_numpy"] / ms[f"io_{p}{v}"]
                                              if f"io_{p}run_numpy" in ms and f"io_{p}{v}" in ms else None)
                              for p in ("", "artifact_") for v in ("vm", "vm_views")}
    return out


def tail_ratios(rows: list) -> dict:
    """--tails: per workload, median time over rows of d / median time over the padded rows, for the VM
    call and run() (None where an engine did not run)."""
    out = {}
    for r in rows:
        ms = {e: d["ms"]["median"] for e, d in r["engines"].items() if "ms" in d}
        out[r["workload"]] = {k: (ms[f"tail_{k}"] / ms[f"tail_padded_{k}"]
                                  if f"tail_{k}" in ms and f"tail_padded_{k}" in ms else None)
                              for k in ("vm", "run")}
    return out


def _error_cause(error: str, chars: int = 300) -> str:
    """A worker's error for the printed table: its exception line (the traceback's last line), not its head."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    cause = lines[-1] if lines else "(no message)"
    return cause if len(cause) <= chars else cause[:chars] + "..."


def print_table(out) -> None:
    """Markdown: one row per workload and engine, ms per call (median of the rounds, p25-p75, min-max)."""
    print(f"\n{out['date']}, {out['cpu']}, {out['threads']} threads, {out['repeat']} interleaved rounds, "
          f"load average {out['load_avg_start'][0]:.1f} -> {out['load_avg_end'][0]:.1f}")
    print("\n| workload | engine | median ms | p25-p75 | min-max | check (max abs err) | build s | floor ms |")
    print("|---|---|---:|---:|---:|---|---:|---:|")
    for r in out["rows"]:
        for e, d in r["engines"].items():
            if "ms" not in d and "check" in d:
                print(f"| {r['workload']} | {e} | - | - | - | {d['check']} | {d['build_s']:.1f} | |")
                continue
            if "ms" not in d:
                why = d.get("skipped") or _error_cause(d.get("error", ""))
                print(f"| {r['workload']} | {e} | - | - | - | not run: {why} | | |")
                continue
            m = d["ms"]
            err = f" ({d['max_abs_error']:.1e})" if "max_abs_error" in d else f" ({d.get('why', '')})"
            fl = f"{r['floor_ms']:.3f}" if r["floor_ms"] else "-"
            print(f"| {r['workload']} | {e} | {m['median']:.3f} | {m['p25']:.3f}-{m['p75']:.3f} | "
                  f"{m['min']:.3f}-{m['max']:.3f} | {d['check']}{err} | {d['build_s']:.1f} | {fl} |")
    for r in out["rows"]:
        info = r["engines"].get("tvm_metaschedule", {}).get("metaschedule")
        if info:
            print(f"tvm_metaschedule {r['workload']}: database {info['database']}, {info['trials_per_task']} trials "
                  f"per task, {info['tasks_with_records']} of {info['tasks']} tasks with a record, tuned in "
                  f"{info['tuning_s']:.0f} s{' under load' if info.get('tuning_on_loaded_machine') else ''}")
    fl = out["floors"]
    print(f"\nfloors: copy {fl['copy_GBps']:.1f} GB/s, matmul {fl['matmul_GFLOPs']:.1f} GFLOP/s (numpy, same run)")


if __name__ == "__main__":
    raise SystemExit(main())
