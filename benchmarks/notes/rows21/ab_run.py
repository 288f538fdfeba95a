"""The three exported softmax artifacts (ART_DIR/art_{old,vec,rowlen}) in one process, interleaved rounds:
python ab_run.py ART_DIR OUT.json."""
import time, json, sys
import numpy as np, tvmfuse
arts = {n: tvmfuse.load(f"{sys.argv[1]}/art_{n}") for n in ("old", "vec", "rowlen")}
res = {}
for seq in (4, 7, 8, 9, 17, 33, 128):
    x = np.random.default_rng(0).standard_normal((512, seq)).astype("float32")
    ref = np.exp(x - x.max(-1, keepdims=True)); ref /= ref.sum(-1, keepdims=True)
    for n, a in arts.items():
        np.testing.assert_allclose(a.run({"x": x})["y"], ref, rtol=1e-5, atol=1e-6)
    t = {n: [] for n in arts}
    names = list(arts)
    for r in range(21):
        for n in (names if r % 2 == 0 else names[::-1]):
            a = arts[n]; t0 = time.perf_counter()
            for _ in range(20):
                a.run({"x": x})
            t[n].append((time.perf_counter() - t0) / 20 * 1e6)
    med = {n: float(np.median(v)) for n, v in t.items()}
    paired = {n: float(np.median(np.array(t[n]) / np.array(t["old"]))) for n in names}
    res[seq] = {"median_us": med, "paired_over_old": paired}
    print(seq, {n: round(v, 1) for n, v in med.items()}, {n: round(v, 3) for n, v in paired.items()}, flush=True)
json.dump(res, open(sys.argv[2], "w"), indent=1)
