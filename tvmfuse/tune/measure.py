"""Measurement that survives bad candidates.

Candidates are featurized and built in a pool of worker processes (``worker.py``, JSON over pipes), then run
one at a time in a runner process (locally) or on every free device of an RPC key (one runner process per
device, each taking a session from TVM's tracker).  Every call has a time limit; a worker that crashes or
hangs is killed and replaced, and the candidate gets an error (``crash``, ``timeout``, ``build``, ``run``,
``rpc`` or ``wrong_result``) instead of a cost.  Outputs are checked against the default schedule's
outputs on the same inputs (normally distributed unless the caller gives samples).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import _compat as C
from ..target import physical_cores
from .features import concrete_shapes

log = logging.getLogger("tvmfuse.tune")


@dataclass(frozen=True)
class MeasureOptions:
    """How candidates are measured; every limit is per candidate."""

    repeat: int = 5                 # timed repeats; the record keeps all of them
    number: int = 1                 # runs per repeat (TVM raises it to reach min_repeat_ms)
    min_repeat_ms: int = 20         # short kernels: repeat them until one repeat lasts this long
    warmup: int = 1                 # untimed runs before timing (after the correctness run)
    build_timeout: float = 60.0     # seconds to apply the template, lower and compile one candidate
    run_timeout: float = 30.0       # seconds to load, check and time one candidate
    n_build: int = 0                # parallel build workers (0: physical cores)
    rtol: float = 1e-3              # output check against the default schedule
    atol: float = 1e-4              # ... scaled by the largest reference magnitude (at least 1)
    tracker: str | None = None      # "host:port" of a TVM RPC tracker; None: measure on this host
    key: str | None = None          # device key registered at the tracker
    startup_timeout: float = 120.0  # seconds for a fresh worker to import TVM


@dataclass
class Result:
    costs: list[float] | None = None
    error: dict | None = None      # {"kind", "message"}
    device: str = "local"
    features: list | None = None   # program features of the built candidate

    @property
    def ok(self) -> bool:
        return self.error is None


def template_ref(template) -> dict:
    """How a worker finds a template class: its module, qualified name and source file."""
    import inspect

    cls = type(template)
    return {"module": cls.__module__, "qualname": cls.__qualname__, "file": inspect.getfile(cls)}


class WorkerError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind, self.message = kind, message


def _describe_exit(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


class Worker:
    """One worker process; ``call`` sends a request and waits for its reply at most ``timeout`` s."""

    def __init__(self, env: dict | None = None):
        r, w = os.pipe()
        self._log = tempfile.TemporaryFile()
        pkg_root = str(Path(__file__).resolve().parent.parent.parent)
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = pkg_root + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-m", "tvmfuse.tune.worker", "--reply-fd", str(w)],
                                     stdin=subprocess.PIPE, stdout=self._log, stderr=self._log,
                                     pass_fds=(w,), env=full_env, text=True, start_new_session=True)
        os.close(w)
        self._replies: queue.Queue = queue.Queue()
        reader = os.fdopen(r, "r")

        def _read():
            for line in reader:
                self._replies.put(line)
            self._replies.put(None)
            reader.close()

        threading.Thread(target=_read, daemon=True).start()

    def _stderr_tail(self, n: int = 600) -> str:
        try:
            self._log.seek(0, os.SEEK_END)
            size = self._log.tell()
            self._log.seek(max(0, size - n))
            return self._log.read().decode(errors="replace").strip()
        except (OSError, ValueError) as e:
            return f"(worker output unreadable: {e})"

    def call(self, request: dict, timeout: float) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            raise WorkerError("crash", f"worker died before the request ({_describe_exit(self.proc.poll())})")
        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise WorkerError("timeout", f"no result within the {timeout:g} s limit; worker killed") from None
        if line is None:
            rc = self.proc.wait()
            tail = self._stderr_tail()
            raise WorkerError("crash", f"worker process died ({_describe_exit(rc)})"
                                       + (f"; its last output: {tail[-400:]}" if tail else ""))
        return json.loads(line)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)   # its own session: the worker and its children
            except ProcessLookupError:
                pass                  # it exited between poll() and the kill: wait() below reaps it
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (subprocess.TimeoutExpired, OSError):
                self.kill()
        self._log.close()


class Pool:
    """``n`` workers; a dead or killed worker is replaced before its next request."""

    def __init__(self, n: int, env: dict | None = None, startup_timeout: float = 120.0):
        self.n, self.env, self.startup_timeout = n, env, startup_timeout
        self._slots: queue.Queue = queue.Queue()
        for _ in range(n):
            self._slots.put(None)
        self._all: list[Worker] = []
        self._lock = threading.Lock()

    def _fresh(self) -> Worker:
        w = Worker(self.env)
        with self._lock:
            self._all.append(w)
        w.call({"cmd": "ping"}, self.startup_timeout)
        return w

    def call(self, request: dict, timeout: float) -> dict:
        w = self._slots.get()
        try:
            if w is None or not w.alive:
                w = self._fresh()
            return w.call(request, timeout)
        except WorkerError as e:
            return {"ok": False, "kind": e.kind, "message": e.message}
        finally:
            self._slots.put(w if (w is not None and w.alive) else None)

    def map(self, requests: list[dict], timeout: float) -> list[dict]:
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.n, len(requests))) as ex:
            return list(ex.map(lambda r: self.call(r, timeout), requests))

    def close(self) -> None:
        for w in self._all:
            w.close()


def rpc_device_count(tracker: str, key: str) -> int:
    """Servers registered at ``tracker`` under ``key`` (free or busy)."""
    from ..errors import TargetError

    host, port = tracker.rsplit(":", 1)
    try:
        summary = C.rpc.connect_tracker(host, int(port)).summary()
    except (OSError, RuntimeError, ValueError) as e:     # TVM retries, then raises RuntimeError
        raise TargetError(f"cannot reach the RPC tracker at {tracker}: {e}") from None
    n = sum(1 for s in summary.get("server_info", [])
            if str(s.get("key", "")).split(":", 1)[-1] == key)
    return n


def compare_outputs(ref: list[np.ndarray], out: list[np.ndarray], rtol: float, atol: float) -> str | None:
    """None when ``out`` matches ``ref``, else what differs (first differing argument)."""
    if len(ref) != len(out):
        return f"{len(out)} arguments, the reference has {len(ref)}"
    for i, (r, o) in enumerate(zip(ref, out)):
        if r.shape != o.shape or r.dtype != o.dtype:
            return f"arg{i}: {o.dtype}{list(o.shape)}, the reference is {r.dtype}{list(r.shape)}"
        if np.issubdtype(r.dtype, np.floating):
            rn, on = np.isnan(r), np.isnan(o)
            if not np.array_equal(rn, on):
                return f"arg{i}: NaN in {int(on.sum())} places, the reference has {int(rn.sum())}"
            fin = ~rn
            scale = max(1.0, float(np.abs(r[fin]).max())) if fin.any() else 1.0
            err = np.abs(o.astype(np.float64) - r.astype(np.float64))
            bad = err > (atol * scale + rtol * np.abs(r.astype(np.float64)))
            bad &= fin
            if bad.any():
                idx = np.unravel_index(int(np.argmax(np.where(bad, err, -1))), r.shape)
                return (f"arg{i}: {int(bad.sum())} of {r.size} values differ from the default schedule's; "
                        f"max abs error {float(err[idx]):.3g} at {tuple(int(j) for j in idx)} "
                        f"(got {float(o[idx]):.6g}, expected {float(r[idx]):.6g}; rtol {rtol:g}, "
                        f"atol {atol:g} x {scale:.3g})")
        elif not np.array_equal(r, o):
            return f"arg{i}: {int((r != o).sum())} of {r.size} values differ from the default schedule's"
    return None


def normal_inputs(func, seed: int = 0, sizes: dict | None = None) -> list[np.ndarray]:
    """One array per PrimFunc parameter (symbolic dimensions sized by ``sizes``): floats standard normal,
    integers zero (a safe index)."""
    rng = np.random.default_rng(seed)
    out = []
    for shape, dtype in concrete_shapes(func, sizes):
        if dtype.startswith("float") or dtype.startswith("bfloat"):
            out.append(rng.standard_normal(shape).astype(dtype))
        else:
            out.append(np.zeros(shape, dtype=dtype))
    return out


@dataclass
class TaskFiles:
    """What workers need of one task: its PrimFunc, template and target, its inputs, the reference."""

    spec: dict
    inputs: str
    reference: list[np.ndarray] = field(default_factory=list)
    reference_source: str = ""
    reference_costs: list | None = None
    reference_error: dict | None = None


def _task_key(task) -> str:
    bucket = getattr(task, "bucket", None)
    return f"{task.workload_key}.{task.family}" + (f".{_safe(bucket)}" if bucket else "")


def _safe(name: str) -> str:
    """A bucket name as a file name ("rows<=16" -> "rows_le_16")."""
    return name.replace("<=", "_le_").replace(">", "_gt_").replace("<", "_lt_")


class Measurer:
    """Featurize, build and run candidates of tasks; owns the worker pools and a scratch directory."""

    def __init__(self, target, options: MeasureOptions | None = None, work_dir: str | None = None):
        self.target = target
        self.options = options or MeasureOptions()
        o = self.options
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="tvmfuse-tune-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        n_build = o.n_build or physical_cores()
        self.builders = Pool(n_build, startup_timeout=o.startup_timeout)
        threads = str(int(target.attrs.get("num-cores", 0) or physical_cores()))
        if o.tracker:
            if not o.key:
                raise ValueError("measuring through an RPC tracker needs a device key")
            n_dev = rpc_device_count(o.tracker, o.key)
            if n_dev == 0:
                from ..errors import TargetError

                raise TargetError(f"no RPC server with key {o.key!r} is registered at tracker {o.tracker}")
            self.device_count = n_dev
        else:
            self.device_count = 1
        self.device_name = f"rpc:{o.key}@{o.tracker}" if o.tracker else "local"
        self.runners = Pool(self.device_count, env={"TVM_NUM_THREADS": threads},
                            startup_timeout=o.startup_timeout)
        self._n = 0
        self._files: dict[str, TaskFiles] = {}

    # ------------------------------------------------------------------ tasks
    def register(self, task, inputs: list[np.ndarray] | None = None) -> TaskFiles:
        """Write the task's PrimFunc and inputs for the workers (enough to featurize its configs)."""
        key = _task_key(task)
        if key in self._files:
            return self._files[key]
        d = self.work_dir / key
        d.mkdir(exist_ok=True)
        func_path = d / "func.json"
        func_path.write_text(C.save_json(task.func))
        arrays = inputs if inputs is not None else normal_inputs(task.func, seed=0,
                                                                 sizes=getattr(task, "sizes", None))
        inputs_path = d / "inputs.npz"
        np.savez(inputs_path, **{f"arg{i}": a for i, a in enumerate(arrays)})
        spec = {"func": str(func_path), "template": template_ref(task.template), "target": str(self.target),
                "bucket": getattr(task, "bucket", None), "sizes": getattr(task, "sizes", None) or {}}
        tf = TaskFiles(spec, str(inputs_path))
        self._files[key] = tf
        return tf

    def prepare(self, task, inputs: list[np.ndarray] | None = None) -> TaskFiles:
        """Register the task and compute its reference outputs: the default schedule's (else, if that
        fails, the unscheduled PrimFunc's); ``task.reference_costs`` gets the default's costs."""
        tf = self.register(task, inputs)
        if not tf.reference_source:
            for source, config in (("default", task.default_config), ("unscheduled", None)):
                res, outs = self._measure(tf, [config], compare=False)[0]
                if res.ok:
                    tf.reference, tf.reference_source = outs, source
                    if source == "default":
                        tf.reference_costs = res.costs
                    break
                log.warning("%s: %s reference failed (%s: %s)", task.name, source, res.error["kind"],
                            res.error["message"])
                if source == "default":
                    tf.reference_error = res.error
            else:
                raise RuntimeError(f"{task.name}: neither the default schedule nor the unscheduled PrimFunc "
                                   f"builds and runs; cannot check candidates")
        task.reference_costs, task.reference_error = tf.reference_costs, tf.reference_error
        return tf

    def _paths(self, tf: TaskFiles) -> tuple[str, str]:
        self._n += 1
        d = Path(tf.inputs).parent
        return str(d / f"cand{self._n}.so"), str(d / f"cand{self._n}.out.npz")

    def _run_request(self, tf: TaskFiles, lib: str, out: str) -> dict:
        o = self.options
        req = {"cmd": "run", "lib": lib, "inputs": tf.inputs, "outputs": out, "number": o.number,
               "repeat": o.repeat, "warmup": o.warmup, "min_repeat_ms": o.min_repeat_ms, "rpc": None}
        if o.tracker:
            req["rpc"] = {"tracker": o.tracker, "key": o.key,
                          "session_timeout": max(1, int(o.run_timeout))}
        return req

    def _measure(self, tf: TaskFiles, configs: list, compare: bool = True) -> list:
        o = self.options
        paths = [self._paths(tf) for _ in configs]
        builds = self.builders.map([{"cmd": "build", "task": tf.spec, "config": c, "out": p[0]}
                                    for c, p in zip(configs, paths)], o.build_timeout)
        results: list = [None] * len(configs)
        to_run = []
        for i, b in enumerate(builds):
            if b.get("ok"):
                to_run.append(i)
            else:
                results[i] = (Result(error={"kind": b["kind"], "message": b["message"]}), None)
        runs = self.runners.map([self._run_request(tf, paths[i][0], paths[i][1]) for i in to_run],
                                o.run_timeout)
        for i, r in zip(to_run, runs):
            device = r.get("device", "local") if r.get("ok") else (
                f"rpc:{o.key}@{o.tracker}" if o.tracker else "local")
            if not r.get("ok"):
                kind = r["kind"]
                results[i] = (Result(error={"kind": kind, "message": r["message"]}, device=device), None)
                continue
            outs = _load_outputs(paths[i][1])
            res = Result(costs=r["costs"], device=device, features=builds[i].get("features"))
            if compare:
                diff = compare_outputs(tf.reference, outs, o.rtol, o.atol)
                if diff is not None:
                    res = Result(error={"kind": "wrong_result", "message": diff}, device=device,
                                 features=res.features)
            results[i] = (res, outs)
        for lib, out in paths:
            for p in (lib, out):
                if os.path.exists(p):
                    os.remove(p)
        return results

    def measure(self, task, configs: list[dict]) -> list[Result]:
        """Build and run ``configs`` of a prepared task; one Result (costs or error) per config."""
        tf = self._files[_task_key(task)]
        return [r for r, _ in self._measure(tf, configs)]

    def confirm(self, task, configs: list[dict], rounds: int) -> list[Result]:
        """Re-time ``configs`` of a prepared task against each other: each is built once, then all run in
        ``rounds`` interleaved rounds (A B C A B C ...: a change of load on a shared host hits all of them
        alike), outputs checked against the reference in every round.  ``Result.costs``: the median of each
        round; a failure in any round makes that config's Result an error."""
        tf = self._files[_task_key(task)]
        o = self.options
        paths = [self._paths(tf) for _ in configs]
        builds = self.builders.map([{"cmd": "build", "task": tf.spec, "config": c, "out": p[0]}
                                    for c, p in zip(configs, paths)], o.build_timeout)
        results: list = [None if b.get("ok") else Result(error={"kind": b["kind"], "message": b["message"]})
                         for b in builds]
        per: list[list[float]] = [[] for _ in configs]
        device = self.device_name
        try:
            for _ in range(rounds):
                for i in range(len(configs)):
                    if results[i] is not None:
                        continue
                    r = self.runners.call(self._run_request(tf, paths[i][0], paths[i][1]), o.run_timeout)
                    if not r.get("ok"):
                        results[i] = Result(error={"kind": r["kind"], "message": r["message"]}, device=device)
                        continue
                    device = r.get("device", device)
                    diff = compare_outputs(tf.reference, _load_outputs(paths[i][1]), o.rtol, o.atol)
                    if diff is not None:
                        results[i] = Result(error={"kind": "wrong_result", "message": diff}, device=device)
                        continue
                    per[i].append(float(np.median(r["costs"])))
        finally:
            for lib, out in paths:
                for p in (lib, out):
                    if os.path.exists(p):
                        os.remove(p)
        return [res if res is not None else Result(costs=per[i], device=device) for i, res in enumerate(results)]

    def features(self, task, configs: list[dict]) -> list[dict]:
        """Program features of each config (``{"ok", "features"}``), or the error that applying it gave.

        Configs are split over the build workers; a chunk whose worker crashes or hangs is retried one
        config at a time, so that only the culprit gets the crash/timeout."""
        tf = self._files[_task_key(task)]
        if not configs:
            return []
        n = self.builders.n
        chunks = [configs[i::n] for i in range(n) if configs[i::n]]
        idx = [list(range(len(configs)))[i::n] for i in range(n) if configs[i::n]]
        replies = self.builders.map([{"cmd": "features", "task": tf.spec, "configs": c} for c in chunks],
                                    self.options.build_timeout)
        out: list = [None] * len(configs)
        for ch, ids, rep in zip(chunks, idx, replies):
            if rep.get("ok"):
                for i, r in zip(ids, rep["results"]):
                    out[i] = r
                continue
            if len(ch) == 1:
                out[ids[0]] = rep
                continue
            singles = self.builders.map([{"cmd": "features", "task": tf.spec, "configs": [c]} for c in ch],
                                        self.options.build_timeout)
            for i, r in zip(ids, singles):
                out[i] = r["results"][0] if r.get("ok") else r
        return out

    def close(self) -> None:
        self.builders.close()
        self.runners.close()
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)


def _load_outputs(path: str) -> list[np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return [z[f"arg{i}"] for i in range(len(z.files))]
