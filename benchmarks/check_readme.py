"""Print the figures benchmarks/README.md's current tables should show, computed from their JSON files.

    python benchmarks/check_readme.py            # print every table (markdown rows, as in the README)
    python benchmarks/check_readme.py --check    # also say which printed rows benchmarks/README.md lacks
    python benchmarks/check_readme.py --tables 6 9

The JSON beside the README is the source: a README row that differs from the row printed here is wrong.
Tables covered (README section: JSON file):
  1   bench_cpu.json                  every engine of one run: medians [p25-p75], checks, ort / tvmfuse
  2b  bench_cpu_ms.json, bench_cpu_ms2.json, bench_cpu_ms3.json   MetaSchedule from the stored databases
  3   bench_cpu_io.json               paired per-round ratios (io_paired), median [90% bootstrap interval]
  3b  bench_cpu_tails.json            paired per-round ratios (tail_paired)
  5   bench_tuner_study.json          the study's pieces: default and each budget's pick, tuning time
  5d  confirm_policy_znver3.json      the confirm rules replayed on the study's records (confirm_policy.py)
  6   bench_models.json               medians [p25-p75], ort / tvmfuse, geomean, kernels, compile time
  9   bench_attention.json            medians [p25-p75], ratios vs unfused and onnxruntime
  9b  bench_models_attention.json, bench_models_attention_znver3.json   attention rule on / off, ratios, kernel counts
  10  symbolic_check.json             symbolic / static per size (ratio of the minima over rounds)
  11  space_fuzz.json                 candidates per family and target, failures
  8b  cuda_corpus_build*.json, cuda_corpus_sass_*.json   kernels per arch, on a CUDA template
Not covered (no JSON or no table): 1t (bench_cpu_torch.json, an older run now in HISTORY.md; --tables 1t),
3c (io_overhead*.json: measured under load only), 5c (no measured run), 6e and 7 (no run recorded;
7 is printed with --tables 7, from export_bench.json or --json FILE; 1 likewise takes --json FILE).
Only the standard library: runs anywhere, reads only the JSON files.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, "README.md")


JSON_OVERRIDE: dict[str, str] = {}   # table -> JSON path given with --json (a fresh run, not yet committed)


def load(name: str):
    path = os.path.join(HERE, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: the JSON of this table is missing (run its command from README.md)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def ms(x: float) -> str:
    """Milliseconds as the tables print them: 3 decimals."""
    return f"{x:.3f}"


def spread(e: dict, key: str = "") -> str:
    if key:
        e = e[key]
    return f"{ms(e['median'])} [{ms(e['p25'])}-{ms(e['p75'])}]"


def spread_ms(e: dict) -> str:
    return f"{ms(e['median_ms'])} [{ms(e['p25_ms'])}-{ms(e['p75_ms'])}]"


def paired(p: dict) -> str:
    return f"{p['median']:.3f} [{p['ci'][0]:.3f}-{p['ci'][1]:.3f}]"


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def header(title: str, d: dict | None, source: str) -> list[str]:
    when = (d or {}).get("date", "")
    cmd = (d or {}).get("command", "")
    out = [f"## {title}  ({source}{', ' + when if when else ''})"]
    if cmd:
        out.append(f"command: {cmd}")
    return out


def table_6() -> list[str]:
    d = load("bench_models.json")
    out = header("Table 6", d, "bench_models.json")
    out.append(f"load average at the end: {', '.join(f'{x:.2f}' for x in d['load_avg_end'])}")
    out += ["| model | tvmfuse ms | ort ms | ort_nospin ms | ort / tvmfuse | kernels | compile s | check |",
            "|---|---:|---:|---:|---:|---|---:|---|"]
    ratios = []
    for r in d["results"]:
        e = r["engines"]
        t, o, n = e["tvmfuse"], e["ort"], e["ort_nospin"]
        ratio = o["median_ms"] / t["median_ms"]
        ratios.append(ratio)
        ok = all(x.get("correct") for x in (t, o, n))
        out.append(f"| {r['model']} | {spread_ms(t)} | {spread_ms(o)} | {spread_ms(n)} | {ratio:.2f}x | "
                   f"{t['kernels_before']} -> {t['kernels']} | {t['compile_s']:.1f} | {'ok' if ok else 'FAIL'} |")
    out.append(f"geomean ort / tvmfuse over {len(ratios)} models: {geomean(ratios):.2f}x; "
               f"lowest {min(ratios):.2f}x; models below 1.0x: "
               f"{', '.join(r['model'] for r, x in zip(d['results'], ratios) if x < 1.0) or 'none'}")
    return out


def table_9() -> list[str]:
    d = load("bench_attention.json")
    out = header("Table 9", d, "bench_attention.json")
    out += ["| workload | tvmfuse ms | unfused ms | ort ms | vs unfused | vs ort | "
            "kernels: op by op / unfused / tvmfuse |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in d["results"]:
        w, e = r["workload"], r["engines"]
        name = f"S={w['seq']}" + (" causal" if w["causal"] else "")
        t, u, o = e["tvmfuse"], e["tvmfuse_unfused"], e["ort"]
        vu, vo = u["median_ms"] / t["median_ms"], o["median_ms"] / t["median_ms"]
        out.append(f"| {name} | {spread_ms(t)} | {spread_ms(u)} | {spread_ms(o)} | {vu:.2f}x | {vo:.2f}x | "
                   f"{t['kernels_before']} / {u['kernels']} / {t['kernels']} |")
    return out


def table_9b() -> list[str]:
    out = []
    for name in ("bench_models_attention.json", "bench_models_attention_znver3.json"):
        out += _table_9b_rows(name)
    return out


def _table_9b_rows(name: str) -> list[str]:
    d = load(name)
    out = header("Table 9b", d, name)
    out += ["| model | tvmfuse ms | attention off ms | ort ms | rule's speedup | vs ort | kernels on / off |",
            "|---|---:|---:|---:|---:|---:|---|"]
    for r in d["results"]:
        e = r["engines"]
        t, n, o = e["tvmfuse"], e["tvmfuse_noattn"], e["ort"]
        out.append(f"| {r['model']} | {spread_ms(t)} | {spread_ms(n)} | {spread_ms(o)} | "
                   f"{n['median_ms'] / t['median_ms']:.2f}x | {o['median_ms'] / t['median_ms']:.2f}x | "
                   f"{t['kernels']} / {n['kernels']} |")
    return out


def _dims(dims: dict) -> str:
    return " ".join(f"{k[0]}{v}" for k, v in dims.items())


def table_10() -> list[str]:
    d = load("symbolic_check.json")
    out = header("Table 10", None, "symbolic_check.json")
    out.append(f"rounds {d['rounds']} x {d['repeat']} calls per size, thread_time {d['thread_time']}, "
               f"shape bounds {d['shape_bounds'] or 'none'}; ratio = symbolic min / static min")
    # Files written since session 10 also carry the paired per-round ratio with its 95% interval.
    has_paired = any("ratio_paired_median" in s for r in d["records"] for s in r.get("sizes", []))
    extra_h, extra_sep = (" paired ratio [95% CI] |", "---:|") if has_paired else ("", "")
    out += ["| model | size | kernels (symbolic / static) | symbolic ms (min) | static ms (min) | ratio |" + extra_h,
            "|---|---|---|---:|---:|---:|" + extra_sep]
    over = []
    for r in d["records"]:
        for s in r.get("sizes", []):
            if "ratio" not in s:
                out.append(f"| {r['model']} | {_dims(s['dims'])} | - | - | - | {s.get('error', 'no timing')} |")
                continue
            mark = f"**{s['ratio']:.2f}**" if s["ratio"] > 1.2 else f"{s['ratio']:.2f}"
            if s["ratio"] > 1.2:
                over.append(f"{r['model']} {_dims(s['dims'])} {s['ratio']:.2f}")
            extra = ""
            if has_paired:
                lo_hi = s.get("ratio_paired_ci95")
                extra = (f" {s['ratio_paired_median']:.2f} [{lo_hi[0]:.2f}-{lo_hi[1]:.2f}] |"
                         if "ratio_paired_median" in s else " - |")
            out.append(f"| {r['model']} | {_dims(s['dims'])} | {r['dyn_kernels']} / {s['pinned_kernels']} | "
                       f"{s['dyn_ms']:.3f} | {s['static_ms']:.3f} | {mark} |" + extra)
    n = sum(1 for r in d["records"] for s in r.get("sizes", []) if "ratio" in s)
    out.append(f"over 1.2x: {len(over)} of {n} sizes: {'; '.join(over)}")
    return out


def table_3() -> list[str]:
    d = load("bench_cpu_io.json")
    out = header("Table 3", d, "bench_cpu_io.json")
    keys = ["run/vm", "run/vm_views", "artifact_run/vm", "artifact_run/vm_views"]
    heads = ["run() / VM call", "run() / VM on views", "artifact run / VM call", "artifact run / VM on views"]
    # Files written since session 10 also pair run() on the VM call's own device tensors (same memory).
    if any("run_same/vm" in p for p in d["io_paired"].values()):
        keys += ["run_same/vm", "artifact_run_same/vm"]
        heads += ["run() on the VM's tensors / VM call", "artifact run on the VM's tensors / VM call"]
    # Files written since session 13 also pair run() on numpy inputs made with numpy's own allocator.
    if any("run_numpy16/vm" in p for p in d["io_paired"].values()):
        keys += ["run_numpy16/vm", "artifact_run_numpy16/vm"]
        heads += ["run(), numpy's own allocator / VM call", "artifact run, numpy's own allocator / VM call"]
    out += ["| workload | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for w, p in d["io_paired"].items():
        out.append(f"| {w} | " + " | ".join(paired(p[k]) if k in p else "-" for k in keys) + " |")
    return out


def table_3b() -> list[str]:
    d = load("bench_cpu_tails.json")
    out = header("Table 3b", d, "bench_cpu_tails.json")
    out += ["| rows of | VM call | run() |", "|---|---:|---:|"]
    for w, p in d["tail_paired"].items():
        out.append(f"| {w.rsplit('_', 1)[1]} | {paired(p['vm'])} | {paired(p['run'])} |")
    return out


def _cpu_rows(d: dict, engines: list[str]) -> dict:
    return {r["workload"]: {e: r["engines"][e] for e in engines if e in r["engines"]} for r in d["rows"]}


def table_1t() -> list[str]:
    d = load("bench_cpu_torch.json")
    out = header("Table 1 (with torch.compile)", d, "bench_cpu_torch.json")
    out += ["| workload | onnxruntime | tvmfuse | torch.compile | ort / tvmfuse |", "|---|---:|---:|---:|---:|"]
    for w, e in _cpu_rows(d, ["ort_default", "tvmfuse", "torch_compile"]).items():
        o, t = e["ort_default"]["ms"]["median"], e["tvmfuse"]["ms"]["median"]
        tc = e.get("torch_compile", {})
        tcs = f"{tc['ms']['median']:.3f}" if tc.get("ms") else "-"
        out.append(f"| {w} | {o:.3f} | {t:.3f} | {tcs} | {o / t:.2f}x |")
    return out


def table_1() -> list[str]:
    """Every engine of one bench_cpu.py run: median [p25-p75] ms, '-' where an engine did not run; the
    checks (every output against the ONNX reference) and tvmfuse's ratio to onnxruntime (default options)."""
    name = JSON_OVERRIDE.get("1", "bench_cpu.json")
    d = load(name)
    out = header("Table 1 (every engine of one run)", d, name)
    engines = [e for e in d["engines"] if e != "onnx_reference"]
    out += ["| workload | " + " | ".join(f"{e} ms" for e in engines) + " | checks | ort_default / tvmfuse |",
            "|---|" + "---:|" * len(engines) + "---|---:|"]
    for r in d["rows"]:
        cells, fails = [], []
        for e in engines:
            x = r["engines"].get(e, {})
            cells.append(spread(x["ms"]) if x.get("ms") else "-")
            if x.get("check") not in (None, "pass"):
                fails.append(e)
        ran = [e for e in d["engines"] if r["engines"].get(e, {}).get("check") == "pass"]
        checks = f"FAIL: {', '.join(fails)}" if fails else f"{len(ran)} pass"
        o, t = (r["engines"].get(e, {}).get("ms") for e in ("ort_default", "tvmfuse"))
        ratio = f"{o['median'] / t['median']:.2f}x" if o and t else "-"
        out.append(f"| {r['workload']} | " + " | ".join(cells) + f" | {checks} | {ratio} |")
    skipped = sorted({f"{e}: {x.get('skipped') or x.get('error', '')[:120]}" for r in d["rows"]
                      for e, x in r["engines"].items() if not x.get("ms") and e != "onnx_reference"
                      and (x.get("skipped") or x.get("error"))})
    out += [f"not run: {s}" for s in skipped]
    return out


def table_2b() -> list[str]:
    out = []
    for name in ("bench_cpu_ms.json", "bench_cpu_ms2.json", "bench_cpu_ms3.json"):
        d = load(name)
        out += header("Table 2b", d, name)
        out += ["| workload | onnxruntime ms | MetaSchedule ms | tvmfuse (untuned) ms | tvmfuse vs MetaSchedule | "
                "tvmfuse vs ort |", "|---|---:|---:|---:|---:|---:|"]
        for w, e in _cpu_rows(d, ["ort_default", "tvm_metaschedule", "tvmfuse"]).items():
            o, m, t = (e[k]["ms"] for k in ("ort_default", "tvm_metaschedule", "tvmfuse"))
            out.append(f"| {w} | {spread(o)} | {spread(m)} | {spread(t)} | {m['median'] / t['median']:.2f}x | "
                       f"{o['median'] / t['median']:.2f}x |")
    return out


def table_5() -> list[str]:
    d = load(JSON_OVERRIDE.get("5", "bench_tuner_study.json"))
    out = []
    for p in d["pieces"]:
        out += [f"## Table 5 piece  (bench_tuner_study.json, {p['date']})", f"command: {p['command']}"]
    cell_ms = lambda c: f"{c['median_s'] * 1e3:.2f}" if "median_s" in c else "error"  # noqa: E731
    secs = lambda c: f"{c['wall_s']:.0f}" if c.get("wall_s") is not None else "-"  # noqa: E731
    for w, wd in d["workloads"].items():
        if "seeds" not in wd:
            out.append(f"workload {w}: skipped: {wd.get('skipped')}")
            continue
        shape = "x".join(str(v) for v in wd["shape"].values())
        for seed, sd in wd["seeds"].items():
            if "error" in sd:
                out.append(f"workload {w} {shape}, seed {seed}: error: {sd['error'][:200]}")
                continue
            confirm = any("tvmfuse_confirmed" in c for c in sd["budgets"].values())
            if confirm:    # runs since the tuner's confirm rounds: the pick they keep, and what it is
                out += [f"workload {w} {shape}, seed {seed}",
                        "| trials | tvmfuse search's pick (ms) | after confirm (ms) | kept | tvmfuse tuning (s) | "
                        "confirm (s) | MetaSchedule (ms) | MetaSchedule tuning (s) |",
                        "|---:|---:|---:|---|---:|---:|---:|---:|",
                        f"| default | {cell_ms(sd['default'])} | | | | | | |"]
            else:
                out += [f"workload {w} {shape}, seed {seed}",
                        "| trials | tvmfuse (ms) | tvmfuse tuning (s) | MetaSchedule (ms) | MetaSchedule tuning (s) |",
                        "|---:|---:|---:|---:|---:|",
                        f"| default | {cell_ms(sd['default'])} | | | |"]
            for b, cell in sorted(sd["budgets"].items(), key=lambda kv: int(kv[0])):
                t, m = cell.get("tvmfuse", {}), cell.get("metaschedule", {})
                ms_cols = f"{cell_ms(m)} | {secs(m)} |" if m else "- | - |"
                if confirm:
                    c = cell.get("tvmfuse_confirmed", {})
                    kept = ("default" if c.get("is_default") else "search's pick" if c.get("is_search_pick")
                            else "a runner-up")
                    out.append(f"| {b} | {cell_ms(t)} | {cell_ms(c)} | {kept} | {secs(t)} | "
                               f"{c.get('confirm_s', 0):.0f} | " + ms_cols)
                else:
                    out.append(f"| {b} | {cell_ms(t)} | {secs(t)} | " + ms_cols)
            cm = sd.get("cost_model")
            out.append(f"cost model (held out): {'none recorded' if not cm else json.dumps(cm)[:200]}")
    for w, tr in d.get("transfer", {}).items():
        if "seeds" not in tr:
            out.append(f"transfer {w}: skipped: {tr.get('skipped')}")
            continue
        shape = "x".join(str(v) for v in tr["shape"].values())
        for seed, sd in tr["seeds"].items():
            if "error" in sd or "default" not in sd:       # an error, or a cell from before the picks were timed
                out.append(f"transfer {w} {shape}, seed {seed}: {sd.get('error', 'no timed picks')}"[:300])
                continue
            out += [f"transfer {w} {shape}, seed {seed}, sources {tr['sources']} ({tr.get('source_trials')} trials each)",
                    "| trials | without the other shapes' records (ms) | with them (ms) | tuning without (s) | "
                    "tuning with (s) |", "|---:|---:|---:|---:|---:|",
                    f"| default | {cell_ms(sd['default'])} | | | |"]
            for b, cell in sorted(sd["budgets"].items(), key=lambda kv: int(kv[0])):
                c, wr = cell["without_records"], cell["with_records"]
                out.append(f"| {b} | {cell_ms(c)} | {cell_ms(wr)} | {secs(c)} | {secs(wr)} |")
    return out


def table_5d() -> list[str]:
    d = load("confirm_policy_znver3.json")
    out = [f"## Table 5d  (confirm_policy_znver3.json, from {d['study']})",
           "| rule | picks | picks not timed | mean kept / default | worst | best | picks slower in >= "
           f"{d['resolved_wins']} final rounds | faster |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for rule, v in d["summary"].items():
        out.append(f"| {rule} | {v['picks']} of {v['cases']} | {v['picks_not_timed']} | {v['mean_final_ratio']:.3f} | "
                   f"{v['worst_final_ratio']:.3f} | {v['best_final_ratio']:.3f} | {v['picks_resolved_slower']} | "
                   f"{v['picks_resolved_faster']} |")
    return out


def table_7_rows(d: dict) -> list[str]:
    """Table 7's rows from an export_bench.py JSON: median over the fresh-interpreter loads [min-max]."""
    out = ["| model | form | size (kB) | import tvmfuse (s) | load (ms) | first run (ms) | run (ms) | check |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in d["rows"]:
        def rng(k, scale, fmt):
            lo, hi = r[k + "_range"]
            return f"{r[k] * scale:{fmt}} [{lo * scale:{fmt}}-{hi * scale:{fmt}}]"

        out.append(f"| {r['model']} | {r['form']} | {r['bytes'] / 1e3:.1f} | {rng('import_s', 1, '.2f')} | "
                   f"{rng('load_s', 1e3, '.1f')} | {rng('first_run_s', 1e3, '.2f')} | {rng('run_s', 1e3, '.3f')} | "
                   f"{r['check']} |")
    return out


def table_7() -> list[str]:
    d = load(JSON_OVERRIDE.get("7", "export_bench.json"))
    return header("Table 7", d, JSON_OVERRIDE.get("7", "export_bench.json")) + table_7_rows(d)


def table_11() -> list[str]:
    d = load("space_fuzz.json")
    out = [f"## Table 11  (space_fuzz.json: {len(d['runs'])} runs)"]
    cols = ["haswell", "skylake", "neon", "cuda"]
    fam: dict = {}
    failures = 0
    for r in d["runs"]:
        failures += len(r["failures"])
        for f, per in r["summary"].items():
            for tgt, counts in per.items():
                fam.setdefault(f, {}).setdefault(tgt, 0)
                fam[f][tgt] += sum(counts.values())
    out += ["| family | haswell | skylake | neon (build) | cuda (build) |", "|---|---|---|---|---|"]
    total = 0
    for f in sorted(fam):
        total += sum(fam[f].values())
        out.append(f"| {f} | " + " | ".join(str(fam[f].get(c, "-")) for c in cols) + " |")
    out.append(f"candidates: {total}, failures: {failures}")
    return out


def table_8b() -> list[str]:
    names = ("cuda_corpus_build.json", "cuda_corpus_build_sm90.json", "cuda_corpus_sass_sm80.json",
             "cuda_corpus_sass_sm90.json")
    out = [f"## Table 8b  ({', '.join(names)})",
           "| arch | date | models | kernels | on a cuda_* template | other schedules | check |",
           "|---|---|---:|---:|---:|---|---|"]
    for name in names:
        d = load(name)
        m = d["models"]
        other = {k: v["other_schedules"] for k, v in m.items() if v.get("other_schedules")}
        kinds = sorted({kind for v in other.values() for kind in v})
        shown = ", ".join(f"{sum(v.get(kind, 0) for v in other.values())} {kind}" for kind in kinds) + \
            f", in {len(other)} models" if other else "none"
        out.append(f"| {d['arch']} | {d['date']} | {len(m)} | {sum(v.get('kernels', 0) for v in m.values())} | "
                   f"{sum(v.get('cuda_templates', 0) for v in m.values())} | {shown} | {d['check']} |")
    return out


def table_8c() -> list[str]:
    """The first GPU run (gpu_run.py, tvmfuse vs stock TVM FuseOps + dlight) beside torch (gpu_torch.py)."""
    run, torch = load("gpu_run_h200_2026-12-04.json"), load("gpu_torch_h200_2026-12-04.json")
    tt = {r["model"]: r for r in torch["rows"]}
    out = ["## Table 8c  (gpu_run_h200_2026-12-04.json, gpu_torch_h200_2026-12-04.json)",
           "| model | family | tvmfuse numbers | rel. error | tvmfuse ms | stock ms | torch eager ms | "
           "torch.compile ms | roofline |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in run["rows"]:
        tf, st, to = r.get("tvmfuse", {}), r.get("stock") or {}, tt.get(r["model"], {})
        if "device_ms" not in tf:
            out.append(f"| {r['model']} | {r.get('family')} | error | | | | | | |")
            continue
        stock = f"{st['device_ms']:.4f}" if "device_ms" in st else "-"
        eager = f"{to['eager_ms']:.4f}" if "eager_ms" in to else "-"
        comp = f"{to['compiled_ms']:.4f}" if "compiled_ms" in to else "-"
        out.append(f"| {r['model']} | {r.get('family')} | {'right' if tf['numerics_ok'] else 'WRONG'} | "
                   f"{tf['rel_err']:.2g} | {tf['device_ms']:.4f} | {stock} | {eager} | {comp} | "
                   f"{r.get('roofline_frac', 0):.1%} |")
    return out


TABLES = {"1": table_1, "2b": table_2b, "3": table_3, "3b": table_3b, "5": table_5, "5d": table_5d, "6": table_6,
          "9": table_9, "9b": table_9b, "10": table_10, "11": table_11, "8b": table_8b,
          "8c": table_8c}
EXTRA = {"1t": table_1t}  # printed when named only: Table 1's older torch.compile run, now in HISTORY.md
PENDING = {"7": table_7}  # no committed JSON yet: printed when named (with --json for a fresh run's file)


def missing_rows(readme_lines, table_lines: list[str]) -> list[str]:
    """The table rows (lines starting with '| ') of ``table_lines`` that ``readme_lines`` lacks verbatim."""
    have = {line.rstrip("\n") for line in readme_lines}
    return [line for line in table_lines if line.startswith("| ") and line not in have]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", nargs="+", choices=[*TABLES, *EXTRA, *PENDING], default=list(TABLES))
    ap.add_argument("--json", default=None,
                    help="with one of --tables 1, 5 or 7: read this JSON (e.g. a fresh run) instead of the committed one")
    ap.add_argument("--check", action="store_true",
                    help="list the printed table rows (lines starting with '| ') benchmarks/README.md lacks")
    args = ap.parse_args(argv)
    if args.json:
        if len(args.tables) != 1 or args.tables[0] not in ("1", "5", "7"):
            ap.error("--json goes with exactly one of --tables 1, 5 or 7")
        JSON_OVERRIDE[args.tables[0]] = os.path.abspath(args.json)
    with open(README, encoding="utf-8") as f:
        readme = f.read().splitlines()
    missing = []
    for t in args.tables:
        try:
            lines = {**TABLES, **EXTRA, **PENDING}[t]()
        except FileNotFoundError as e:
            print(f"check_readme.py: table {t}: {e}", file=sys.stderr)
            return 2
        print("\n".join(lines) + "\n")
        if args.check and t in TABLES:
            missing += [(t, line) for line in missing_rows(readme, lines)]
    if args.check:
        for t, line in missing:
            print(f"not in README.md (table {t}): {line}")
        print(f"check: {len(missing)} row(s) of the JSON not in benchmarks/README.md")
        return 1 if missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
