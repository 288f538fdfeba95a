"""Error of the float32 CPU attention kernel and of onnx's float32 ReferenceEvaluator against the float64 truth
of the same float32 inputs (tests/conftest.py ``reference_outputs_f64``), over many input seeds, for the
attention tests with logits ~1e4 (inputs x30): tests/test_attention.py ``test_fully_masked_row_and_large_
magnitudes``, test_attention_blocks.py ``test_64_key_blocks_and_folded_rescale_match_reference``,
test_attention_exp2.py ``test_both_bases_match_reference``, test_attention_prefetch.py
``test_every_prefetch_level_matches_reference``.  Each kernel is built once (the tests' kernels and configs)
and run on the inputs each test draws from ``numpy.random.default_rng(seed)`` (the ``rng`` fixture of
``pytest --rng-seed=seed``).

Per case and seed: ``kernel`` = max |kernel - f64| / max |f64| (NaNs where the reference has them
skipped), ``ref32`` = the same of the float32 reference, ``kernel_vs_ref32`` = max |kernel - ref32| / max
|ref32| (what session 9's check measured), ``logit_abs`` = max |float32 logits - float64 logits| (numpy,
Q scaled first as the kernel does).  The tests' bound is 1e-4 of the output's scale.

    PYTHONPATH=. python benchmarks/attention_reference_error.py --inputs gaussian --seeds 0:100 1311701824 \\
        2937163442 --out benchmarks/notes/review10_reference_error_gaussian.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _scaled(got, ref):
    finite = ~np.isnan(ref)
    assert np.isnan(got[~finite]).all(), "NaN pattern differs"
    return float(np.max(np.abs(got[finite] - ref[finite])) / np.max(np.abs(ref[finite])))


def _logit_error(model, fe) -> float:
    """max |float32 logits - float64 logits| over the visible keys: (Q s) . K (+ mask) in numpy float32 (the
    kernel's order of the scale: Q scaled first) against float64 from the same inputs."""
    s = next(float(np.asarray(onnx_numpy(i))) for i in model.graph.initializer if i.name == "s")
    if any(n.op_type == "Div" for n in model.graph.node):
        s = 1.0 / s
    q, k = fe["q"], fe["k"]
    l32 = (q * np.float32(s)) @ np.swapaxes(k, -1, -2)
    l64 = (q.astype(np.float64) * s) @ np.swapaxes(k, -1, -2).astype(np.float64)
    mask = fe.get("mask")
    if mask is None:
        mask = next((onnx_numpy(i) for i in model.graph.initializer if i.name == "mask"), None)
    if mask is not None:
        l32, l64 = l32 + mask, l64 + mask.astype(np.float64)
    ok = np.isfinite(l64)
    return float(np.max(np.abs(l32.astype(np.float64)[ok] - l64[ok])))


def onnx_numpy(tensor):
    from onnx import numpy_helper
    return numpy_helper.to_array(tensor)


def cases(host, whole: bool):
    """(name, model, feeds(rng) -> dict, runners: {config name: feeds -> output})."""
    import tvmfuse
    from tvmfuse import fastmath as F
    from tvmfuse.schedules.base import schedule_with
    from tvmfuse.schedules.cpu.attention import Attention
    from test_attention import _attention_func, _chain, _feeds, _large_logit_feeds, _run_kernel
    from test_attention_blocks import _causal

    t = Attention()
    draw = _large_logit_feeds if whole else (lambda model, rng: _feeds(model, rng, scale=30.0))

    def masked_row_feeds(model, rng):      # an input mask's row 4 fully masked (NaN, as onnx's Softmax)
        fe = draw(model, rng)
        if "mask" in fe:
            fe["mask"][0, 0, 4, :] = -np.inf
        return fe

    def kernels(model, overs, fastmath=False):
        func = _attention_func(tvmfuse.compile(model, host, schedules=False))
        match = t.match(func, host)
        base = t.default_config(match, host)
        out = {}
        for over in overs(base):
            sched = schedule_with(t, match, func, {**base, **over})
            if fastmath:
                sched, _ = F.rewrite(sched)
            out[json.dumps(over, sort_keys=True)] = sched
        names = ["q", "k", "v"] + (["mask"] if any(i.name == "mask" for i in model.graph.input) else [])
        shape = tuple(d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim)
        return {k: (lambda fe, s=s: _run_kernel(s, [fe[n] for n in names], shape, host)) for k, s in out.items()}

    # tests/test_attention.py test_fully_masked_row_and_large_magnitudes: the compiled model
    model = _chain(mask="input")
    cm = tvmfuse.compile(model, host)

    def masked_feeds(rng, model=model):
        fe = draw(model, rng)
        fe["mask"][0, 0, 4, :] = -np.inf
        fe["mask"][1, 0, :, 5:] = -np.inf
        return fe
    yield "masked_large", model, masked_feeds, {"compiled": lambda fe: cm.run(fe)["y"]}

    # test_attention_blocks.py test_64_key_blocks_and_folded_rescale_match_reference
    for seq, mask in ((128, None), (512, "input"), (77, "causal"), (77, "input")):
        model = _chain(b=1, h=2, sq=seq, sk=seq, d=64, dv=64, mask=_causal(seq) if mask == "causal" else mask)
        yield (f"blocks_s{seq}_{mask}", model, lambda rng, model=model: masked_row_feeds(model, rng),
               kernels(model, lambda b: (dict(k_block=64, rows=4), dict(k_block=64, rows=1), dict(k_block=32, rows=4))))

    for mask in ("input", "causal"):
        m = _causal(45) if mask == "causal" else mask
        model = _chain(b=1, h=2, sq=45, sk=45, d=16, dv=16, mask=m)

        # test_attention_exp2.py test_both_bases_match_reference (after fastmath)
        def exp2_feeds(rng, model=model):
            fe = draw(model, rng)
            if "mask" in fe:
                fe["mask"] *= 10.0
                fe["mask"][0, 0, 4, :] = -np.inf
            return fe
        yield (f"exp2_{mask}", model, exp2_feeds,
               kernels(model, lambda b: [dict(q_block=b["lanes"], q_blocks=2, pack_kv=1, exp2=e) for e in (0, 1)],
                       fastmath=True))

        # test_attention_prefetch.py test_every_prefetch_level_matches_reference
        yield (f"prefetch_{mask}", model, lambda rng, model=model: masked_row_feeds(model, rng),
               kernels(model, lambda b: (dict(q_block=b["lanes"], q_blocks=2, pack_kv=1, prefetch=2),
                                         dict(q_block=b["lanes"], q_blocks=1, pack_kv=0, prefetch=1))))


def _seeds(tokens):
    out = []
    for tok in tokens:
        if ":" in tok:
            lo, hi = (int(x) for x in tok.split(":"))
            out += list(range(lo, hi))
        else:
            out.append(int(tok))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", nargs="+", default=["0:30"], help="seeds and lo:hi ranges")
    ap.add_argument("--inputs", choices=("gaussian", "whole"), default="whole",
                    help="gaussian: q, k, v, mask ~ N(0, 30^2) (session 9's tests); whole: q, k and mask rounded "
                         "to whole numbers (the tests' _large_logit_feeds: exact float32 logits)")
    ap.add_argument("--only", nargs="+", default=None, help="run the cases whose name starts with one of these")
    ap.add_argument("--out", default=None, help="JSON file of every (case, config, seed) figure")
    args = ap.parse_args(argv)
    import tvmfuse
    from tvmfuse import models as M
    from conftest import reference_outputs_f64

    host = tvmfuse.host_target()
    seeds = _seeds(args.seeds)
    rows = []
    for name, model, feeds_of, runners in cases(host, args.inputs == "whole"):
        if args.only and not name.startswith(tuple(args.only)):
            continue
        for seed in seeds:
            fe = feeds_of(np.random.default_rng(seed))
            r64 = reference_outputs_f64(model, fe)["y"]
            r32 = M.reference_outputs(model, fe)["y"]
            e_ref = _scaled(r32.astype(np.float64), r64)
            e_logit = _logit_error(model, fe)
            for cfg, run in runners.items():
                got = run(fe).astype(np.float64)
                rows.append(dict(case=name, config=cfg, seed=seed, kernel=_scaled(got, r64), ref32=e_ref,
                                 logit_abs=e_logit,
                                 kernel_vs_ref32=_scaled(got, r32.astype(np.float64))))
        sub = [r for r in rows if r["case"] == name]
        worst = max(sub, key=lambda r: r["kernel"])
        print(json.dumps(dict(case=name, seeds=len(seeds), kernel_max=worst["kernel"], at=worst["seed"],
                              config=worst["config"], ref32_max=max(r["ref32"] for r in sub),
                              kernel_vs_ref32_max=max(r["kernel_vs_ref32"] for r in sub),
                              logit_abs_max=max(r["logit_abs"] for r in sub),
                              kernel_over_1e4=sum(r["kernel"] > 1e-4 for r in sub),
                              ref32_over_1e4=sum(r["ref32"] > 1e-4 for r in sub) // max(1, len(runners)),
                              runs=len(sub))), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(host=str(host), inputs=args.inputs, seeds=seeds, rows=rows), f, indent=0)


if __name__ == "__main__":
    main()
