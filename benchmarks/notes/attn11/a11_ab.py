"""Paired A/B of exported builds, base tree vs new tree (a11_export.py into ART/base and ART/new): bloom and
swin (env MODELS: others), static build at the model's batch and the symbolic build at batch 1 and 3 (32
tokens); one process, one runtime thread, thread CPU time, interleaved rounds alternating the order; median of
the per-round new/base ratio.
python a11_ab.py OUT.json   (env ART, ROUNDS, NUMBER)"""
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, "corpus")
import corpus_io  # noqa: E402
import tvmfuse  # noqa: E402

ART = os.environ.get("ART", "/tmp/attn11/art")
ROUNDS, NUMBER = int(os.environ.get("ROUNDS", 15)), int(os.environ.get("NUMBER", 20))
entries = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": os.getloadavg()[0],
       "clock": f"thread_time, TVM_NUM_THREADS=1, {ROUNDS} rounds x {NUMBER} run() calls, rotating order",
       "rows": []}
for name in os.environ.get("MODELS", "bloom,swin").split(","):
    for tag, batch in (("static", None), ("sym", 1), ("sym", 3)):
        builds = {tree: tvmfuse.load(os.path.join(ART, tree, f"{name}_{tag}"), num_threads=1)
                  for tree in ("base", "new")}
        rng = np.random.default_rng(batch or 0)
        # the symbolic builds at the static build's 32 tokens (bloom_dyn; swin has a batch only)
        feeds = corpus_io.random_feeds(entries[name], rng, dims={"batch": batch, "sequence": 32} if batch else None)
        ref = builds["base"].run(feeds)
        got = builds["new"].run(feeds)
        err = max(corpus_io.relative_error(got[o], ref[o]) for o in ref)
        times = {k: [] for k in builds}
        keys = list(builds)
        for r in range(ROUNDS):
            for k in (keys if r % 2 == 0 else keys[::-1]):
                b = builds[k]
                t0 = time.thread_time()
                for _ in range(NUMBER):
                    b.run(feeds)
                times[k].append((time.thread_time() - t0) / NUMBER * 1e3)
        row = {"model": name, "build": tag, "batch": batch, "rel_err_new_vs_base": err,
               "ms_min_median": {k: [round(min(v), 4), round(statistics.median(v), 4)] for k, v in times.items()},
               "new/base": round(statistics.median(x / y for x, y in zip(times["new"], times["base"])), 3)}
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
out["load_end"] = os.getloadavg()[0]
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
