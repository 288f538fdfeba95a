"""symconv11: a corpus model's build pinned to ``--dims`` (static) at two commits, paired and interleaved in one
process (the old one exported by a child process with the old tree on PYTHONPATH), one runtime thread, thread
CPU time.  Measured under load.  ``benchmarks/symbolic_commit_ab.py`` compares the symbolic builds; this the
static ones (symconv11's depthwise stack-tile rule changes a static kernel whose nest is parallel).

    TVM_NUM_THREADS=1 PYTHONPATH=. python benchmarks/notes/symconv11/static_commit_ab.py mobilenet_v2 \
        --dims batch=8 --old-tree /tmp/symconv11_base --json benchmarks/notes/symconv11_commit_ab.jsonl
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import symbolic_commit_ab as SC  # noqa: E402

_EXPORT = ("import json, sys, tvmfuse; cm = tvmfuse.compile(sys.argv[1], input_shapes=json.loads(sys.argv[3])); "
           "tvmfuse.export(cm, sys.argv[2])")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dims", required=True)
    ap.add_argument("--old-tree", required=True)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    import tvmfuse
    from tvmfuse.io import validate_feeds

    entry = {e["name"]: e for e in SC.corpus_io.load_manifest()["models"]}[a.model]
    dims = {k: int(v) for k, v in (p.split("=") for p in a.dims.split(","))}
    path = os.path.abspath(SC.corpus_io.model_path(entry, "dynamic"))
    with tempfile.TemporaryDirectory(prefix="static-ab-") as tmp:
        old_path = os.path.join(tmp, "old")
        env = {**os.environ, "PYTHONPATH": os.path.abspath(a.old_tree)}
        subprocess.run([sys.executable, "-c", _EXPORT, path, old_path, json.dumps(dims)], env=env, check=True,
                       cwd=a.old_tree)
        builds = {"new_static": tvmfuse.compile(path, input_shapes=dims, num_threads=1),
                  "old_static": tvmfuse.load(old_path, num_threads=1)}
        feeds = SC.corpus_io.random_feeds(entry, np.random.default_rng(0), dims=dims)
        got = {n: cm.run(feeds) for n, cm in builds.items()}
        for k in got["new_static"]:
            np.testing.assert_allclose(got["new_static"][k], got["old_static"][k], rtol=1e-4, atol=1e-5, err_msg=k)
        calls = {}
        for n, cm in builds.items():
            args = [cm._to_device(v)[0] for v in validate_feeds(feeds, cm.inputs, cm.shape_upper_bounds)]
            f = cm._main()
            for _ in range(3):
                f(*args)
            calls[n] = (f, args)
        ts = {n: [] for n in calls}
        for _ in range(a.rounds):
            for n, (f, args) in calls.items():
                t0 = time.thread_time()
                for _ in range(a.repeat):
                    f(*args)
                ts[n].append((time.thread_time() - t0) / a.repeat * 1e6)
    rec = {"model": a.model, "dims": dims, "old_tree": a.old_tree, "clock": "thread_time, 1 thread",
           "note": "measured under load; static builds at two commits", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_1min_end": round(os.getloadavg()[0], 2), "rounds": a.rounds, "repeat": a.repeat,
           "min_us": {n: round(min(t), 2) for n, t in ts.items()},
           "paired_median_new_over_old": round(float(np.median(np.array(ts["new_static"]) / np.array(ts["old_static"]))), 3)}
    print(json.dumps(rec))
    if a.json:
        with open(a.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
