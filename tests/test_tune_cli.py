"""`tvmfuse tune` end to end: kill -9 mid-job and resume (no record lost, no trial re-spent); tuning
through an RPC tracker with two servers on loopback; the tuned log applied by `tvmfuse.pipeline`."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import onnx
import pytest

import tvmfuse
from tvmfuse import models as M
from tvmfuse.tune import MeasureOptions, TuneOptions, Tuner, task_for
from tvmfuse.tune import log as L

from test_tune import FAST, SplitVec, scale_add_func

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _measures(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip() and '"type":"measure"' in line]


def test_kill_9_mid_job_then_resume(tmp_path, host):
    model = tmp_path / "chain.onnx"
    onnx.save(M.matmul_bias_act(32, 48, 64, act="Relu"), model)
    log_path = tmp_path / "tune.jsonl"
    cmd = [sys.executable, "-m", "tvmfuse", "tune", str(model), "--trials", "10", "--batch", "2",
           "--log", str(log_path), "--plot", "none"]
    # the jobs' scratch directories (tvmfuse-tune-*) under tmp_path: the killed one cannot remove its own
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {**ENV, "TMPDIR": str(scratch)}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True)
    deadline = time.monotonic() + 120
    while len(_measures(log_path)) < 4 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    assert p.poll() is None, "the job ended before it could be killed: " + p.stdout.read().decode()[-2000:]
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    p.stdout.close()
    first = open(log_path, "rb").read()
    before = L.load(log_path, host, all_targets=True).measures
    assert 4 <= len(before) < 10
    left = sorted(scratch.glob("tvmfuse-tune-*"))
    assert len(left) == 1, left                     # the killed job's, in TMPDIR
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(scratch.glob("tvmfuse-tune-*")) == left, "a job that ends removes its scratch directory"
    after = open(log_path, "rb").read()
    assert after.startswith(first[: first.rfind(b"\n") + 1]), "records of the killed job are kept as they were"
    recs = L.load(log_path, host).measures
    assert len(recs) == 10, f"{len(recs)} records"
    ids = [(r["workload_key"], L.config_id(r["config"])) for r in recs]
    assert len(set(ids)) == len(ids), "no configuration measured twice"
    assert f"{10 - len(before)} trials measured" in out.stdout, out.stdout
    # the finished job rerun: nothing to do
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert again.returncode == 0 and "0 trials measured" in again.stdout, again.stdout + again.stderr
    assert len(L.load(log_path, host).measures) == 10
    # the log applies: the pipeline's schedule record says "tuned" for the tuned kernel
    cm = tvmfuse.compile(str(model), tuning_log=str(log_path))
    tuned = [s for s in cm.report.schedules if s.get("source") == "tuned"]
    assert tuned, cm.report.schedules
    best = L.best_configs(str(log_path), host)
    assert any(s.get("knobs") == best[r["workload_key"]]["config"] for s in tuned for r in recs[:1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def rpc_fleet(tmp_path):
    """A tracker and two servers of one key on 127.0.0.1, stopped (by pid) at the end."""
    port = _free_port()
    procs = []
    logs = []

    def start(args, name):
        f = open(tmp_path / f"{name}.log", "w")
        logs.append(tmp_path / f"{name}.log")
        procs.append(subprocess.Popen([sys.executable, "-m", *args], stdout=f, stderr=subprocess.STDOUT,
                                      env=ENV, start_new_session=True))
        f.close()

    start(["tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port), "--port-end", str(port + 1)],
          "tracker")
    key = "tvmfuse-test"
    deadline = time.monotonic() + 60
    while True:                       # the tracker listens (a raw connect: no TVM retry loop)
        assert procs[0].poll() is None, "tracker exited: " + open(logs[0]).read()[-1500:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "tracker did not start: " + open(logs[0]).read()[-1500:]
            time.sleep(0.2)
    for i in range(2):
        sp = _free_port()
        start(["tvm.exec.rpc_server", "--host", "127.0.0.1", "--port", str(sp), "--port-end", str(sp + 50),
               "--tracker", f"127.0.0.1:{port}", "--key", key], f"server{i}")
    from tvmfuse.tune.measure import rpc_device_count

    while rpc_device_count(f"127.0.0.1:{port}", key) < 2:
        assert time.monotonic() < deadline, "servers did not register: " + open(logs[1]).read()[-1500:]
        time.sleep(0.2)
    yield f"127.0.0.1:{port}", key, logs
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=10)


def test_tune_through_rpc_tracker_with_two_servers(tmp_path, host, rpc_fleet):
    tracker, key, logs = rpc_fleet
    task = task_for(scale_add_func(), host, "scale_add", templates=[SplitVec()])
    log_path = tmp_path / "rpc.jsonl"
    mo = MeasureOptions(repeat=3, min_repeat_ms=5, build_timeout=30, run_timeout=30, n_build=2,
                        tracker=tracker, key=key)
    res = Tuner([task], host, log_path, TuneOptions(trials=9, batch=8), mo).run()
    recs = L.load(log_path, host).measures
    assert len(recs) == 9 and all(r["error"] is None and r["costs"] for r in recs), recs
    assert all(r["device"] == f"rpc:{key}@{tracker}" for r in recs)
    assert res.tasks[0]["best"] is not None
    # both servers took sessions (each logs the connections it serves)
    served = [open(p).read().count("load_module") for p in logs[1:]]
    assert all(n >= 1 for n in served), served


def test_kernel_inputs_from_user_samples(host):
    """--inputs: kernels are measured on the arguments they get when the model runs on the samples."""
    import numpy as np

    from tvmfuse.tune.tasks import extract_tasks, kernel_inputs_from_samples

    model = M.matmul_bias_act(16, 24, 32, act="Relu")
    tasks = extract_tasks(model, host)
    feeds = {k: (np.random.default_rng(1).uniform(0, 1, v.shape)).astype(v.dtype)
             for k, v in M.random_feeds(model).items()}
    got = kernel_inputs_from_samples(model, host, feeds, tasks)
    first = got[tasks[0].workload_key]
    assert [list(a.shape) for a in first] == [p[0] for p in tasks[0].workload["params"]]
    x = next(iter(feeds.values()))
    assert any(a.shape == x.shape and np.array_equal(a, x) for a in first), "the sample reached the kernel"


def test_tune_warm_start_missing_log_is_one_error_line(tmp_path, capsys):
    """``--warm-start`` names a log of other workloads; a missing one is an error naming it, before any work."""
    from tvmfuse.cli import main

    model = tmp_path / "chain.onnx"
    onnx.save(M.matmul_bias_act(8, 16, 16, act="Relu"), model)
    missing = tmp_path / "other.jsonl"
    rc = main(["tune", str(model), "--trials", "1", "--log", str(tmp_path / "t.jsonl"), "--warm-start", str(missing)])
    err = capsys.readouterr().err
    assert rc == 2 and f"--warm-start {missing}: no such file" in err and "Traceback" not in err, err
    assert not (tmp_path / "t.jsonl").exists(), "nothing tuned, no log written"
    rc = main(["tune", str(model), "--trials", "1", "--log", str(tmp_path / "t.jsonl"), "--warm-start-seeds", "-1"])
    assert rc == 2 and "--warm-start-seeds must be 0 or more" in capsys.readouterr().err
