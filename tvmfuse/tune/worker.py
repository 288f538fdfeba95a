"""A tuning worker process: featurizes, builds and runs candidates for the parent (``measure.py``).

Run as ``python -m tvmfuse.tune.worker``.  The protocol is JSON lines: one request on stdin, one reply on
the file descriptor given by ``--reply-fd`` (the worker's own stdout and stderr carry TVM's chatter, never
replies).  A candidate that crashes the process (a segfault in a template or in generated code) or hangs is
the parent's to contain: it sees the reply pipe close or its time limit pass, kills this process if
needed, records an error and starts a new worker.  Nothing here is pickled.

Requests (``cmd``):
- ``features``: ``{task, configs}`` -> ``{results: [{ok, features} | {ok: false, kind, message}]}``
- ``build``: ``{task, config (null: the unscheduled PrimFunc), out}`` -> ``{ok}`` or an error
- ``run``: ``{lib, inputs, outputs, number, repeat, warmup, min_repeat_ms, rpc}`` -> ``{ok, costs}``
where ``task`` is ``{func: path of the PrimFunc JSON, template: {module, qualname, file}, target: JSON,
bucket: a size bucket's name or null, sizes: {shape variable: size}}``: a bucket's nest is built over the
symbolic shapes (what the model runs), its arguments described at ``sizes`` for the features.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback

import numpy as np

_TASKS: dict = {}   # func path -> (func, template, match, target)


def load_template(ref: dict):
    try:
        mod = importlib.import_module(ref["module"])
    except ModuleNotFoundError:
        # a template defined outside an importable package (a test file, a script): load it from its source
        # file, with its folder importable (it may import its neighbours, as the script itself could)
        folder = os.path.dirname(os.path.abspath(ref["file"]))
        if folder not in sys.path:
            sys.path.append(folder)
        spec = importlib.util.spec_from_file_location(ref["module"], ref["file"])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[ref["module"]] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[ref["module"]]     # no half-loaded module for the next request to find
            raise
    obj = mod
    for part in ref["qualname"].split("."):
        obj = getattr(obj, part)
    return obj()


def _task(spec: dict):
    from .. import _compat as C

    key = spec["func"]
    if key not in _TASKS:
        with open(key) as f:
            func = C.load_json(f.read())
        target = C.Target(json.loads(spec["target"]))
        template = load_template(spec["template"])
        match = template.match(func, target)
        if match is None:
            raise RuntimeError(f"template {template.family} no longer matches the workload")
        if spec.get("bucket"):      # one size bucket's nest (schedules.buckets)
            buckets = {b.name: b for b in template.buckets(match, target)}
            if spec["bucket"] not in buckets:
                raise RuntimeError(f"template {template.family} has no size bucket {spec['bucket']!r} "
                                   f"(it has {sorted(buckets)})")
            match = template.bucket_match(match, buckets[spec["bucket"]])
        _TASKS[key] = (func, template, match, target)
    return _TASKS[key]


def _scheduled(spec: dict, config: dict | None):
    from .. import _compat as C
    from ..schedules.base import schedule_with

    func, template, match, target = _task(spec)
    if config is not None:
        func = schedule_with(template, match, func, config)
    # the exported library's entry point is "main" (MakePackedAPI exposes functions with a global symbol)
    return C.IRModule({"main": func.with_attr("global_symbol", "main")}), target


def _err(kind: str, e: BaseException) -> dict:
    msg = f"{type(e).__name__}: {e}".strip()
    if len(msg) > 2000:
        msg = msg[:2000] + " ..."
    return {"ok": False, "kind": kind, "message": msg}


def cmd_features(req: dict) -> dict:
    from .features import per_store_features, program_features

    results = []
    for config in req["configs"]:
        try:
            mod, target = _scheduled(req["task"], config)
            feats = program_features(per_store_features(mod, target, req["task"].get("sizes")))
            results.append({"ok": True, "features": np.round(feats, 5).tolist()})
        except Exception as e:  # an illegal config: reported per config, the batch goes on
            results.append(_err("build", e))
    return {"ok": True, "results": results}


def cmd_build(req: dict) -> dict:
    from .. import _compat as C

    from .features import per_store_features, program_features

    t0 = time.perf_counter()
    try:
        mod, target = _scheduled(req["task"], req.get("config"))
        feats = np.round(program_features(per_store_features(mod, target, req["task"].get("sizes"))),
                         5).tolist()
        lib = C.build_prim_module(mod, target)
        lib.export_library(req["out"])
    except Exception as e:
        return _err("build", e)
    return {"ok": True, "seconds": time.perf_counter() - t0, "features": feats}


def _load_arrays(path: str) -> list[np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return [z[f"arg{i}"] for i in range(len(z.files))]


def cmd_run(req: dict) -> dict:
    from .. import _compat as C

    arrays = _load_arrays(req["inputs"])
    rpc = req.get("rpc")
    try:
        if rpc:
            host, port = rpc["tracker"].rsplit(":", 1)
            tracker = C.rpc.connect_tracker(host, int(port))
            remote = tracker.request(rpc["key"], priority=1, session_timeout=int(rpc["session_timeout"]))
            remote.upload(req["lib"])
            module = remote.load_module(os.path.basename(req["lib"]))
            dev = remote.cpu(0)
            where = f"rpc:{rpc['key']}@{rpc['tracker']}"
        else:
            module = C.load_module(req["lib"])
            dev = C.cpu(0)
            where = "local"
    except Exception as e:
        return _err("rpc" if rpc else "run", e)
    try:
        args = [C.tensor(a, dev) for a in arrays]
        f = module["main"]
        f(*args)                                    # the correctness run on the given inputs
        if req.get("outputs"):
            np.savez(req["outputs"], **{f"arg{i}": a.numpy() for i, a in enumerate(args)})
        for _ in range(int(req.get("warmup", 1))):
            f(*args)
        timer = C.time_function(module, "main", dev, number=int(req["number"]), repeat=int(req["repeat"]),
                                min_repeat_ms=int(req.get("min_repeat_ms", 0)))
        costs = [float(c) for c in timer(*args).results]
    except Exception as e:
        return _err("run", e)
    return {"ok": True, "costs": costs, "device": where}


def cmd_ping(req: dict) -> dict:
    from .. import _compat  # noqa: F401  (import TVM now, within the startup limit)

    return {"ok": True, "pid": os.getpid()}


def cmd_test_crash(req: dict) -> dict:
    """Kill this worker with a signal (tests of the parent's containment)."""
    import signal

    os.kill(os.getpid(), getattr(signal, req.get("signal", "SIGSEGV")))
    return {"ok": False}


COMMANDS = {"features": cmd_features, "build": cmd_build, "run": cmd_run, "ping": cmd_ping,
            "test_crash": cmd_test_crash}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tvmfuse.tune.worker")
    p.add_argument("--reply-fd", type=int, required=True)
    args = p.parse_args(argv)
    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            res = COMMANDS[req["cmd"]](req)
        except Exception as e:  # a bug in the worker itself: reply with the traceback, keep serving
            res = {"ok": False, "kind": "crash", "message": f"worker error: {e}\n{traceback.format_exc()}"}
        reply.write(json.dumps(res) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
