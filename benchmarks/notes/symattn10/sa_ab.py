"""Paired A/B of exported builds (base vs new tree; symbolic vs pinned to the size), one process, one runtime
thread, thread CPU time, interleaved rounds with a rotating order."""
import json, os, statistics, sys, time
import numpy as np
sys.path.insert(0, "corpus")
import corpus_io
import tvmfuse

ART = os.environ.get("ART", "/tmp/sa_art")   # where sa_export.py wrote each tree's artifacts (base/, new/)
ROUNDS, NUMBER = int(os.environ.get("ROUNDS", 15)), int(os.environ.get("NUMBER", 20))
entries = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": os.getloadavg()[0],
       "clock": f"thread_time, TVM_NUM_THREADS=1, {ROUNDS} rounds x {NUMBER} run() calls, rotating order",
       "rows": []}
for name in ("mobilevit", "swin"):
    for batch in (1, 3):
        builds = {f"{tree}_{kind}": tvmfuse.load(os.path.join(ART, tree, f"{name}_{'sym' if kind == 'sym' else f'b{batch}'}"), num_threads=1)
                  for tree in ("base", "new") for kind in ("sym", "pin")}
        rng = np.random.default_rng(batch)
        feeds = corpus_io.random_feeds(entries[name], rng, dims={"batch": batch})
        ref = builds["base_pin"].run(feeds)
        errs = {}
        for k, b in builds.items():
            got = b.run(feeds)
            errs[k] = max(corpus_io.relative_error(got[o], ref[o]) for o in ref)
        times = {k: [] for k in builds}
        keys = list(builds)
        for r in range(ROUNDS):
            order = keys[r % len(keys):] + keys[:r % len(keys)]
            for k in order:
                b = builds[k]
                t0 = time.thread_time()
                for _ in range(NUMBER):
                    b.run(feeds)
                times[k].append((time.thread_time() - t0) / NUMBER * 1e3)
        def ratio(a, b):
            return round(statistics.median(x / y for x, y in zip(times[a], times[b])), 3)
        row = {"model": name, "batch": batch, "rel_err_vs_base_pin": errs,
               "ms_min_median": {k: [round(min(v), 4), round(statistics.median(v), 4)] for k, v in times.items()},
               "new_sym/base_sym": ratio("new_sym", "base_sym"), "new_pin/base_pin": ratio("new_pin", "base_pin"),
               "base_sym/base_pin": ratio("base_sym", "base_pin"), "new_sym/new_pin": ratio("new_sym", "new_pin")}
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
out["load_end"] = os.getloadavg()[0]
json.dump(out, open(sys.argv[1], "w"), indent=1)
