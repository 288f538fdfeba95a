"""``tvmfuse tune`` and ``tvmfuse logs merge|best|show``."""
from __future__ import annotations

import json
import os
import sys
import time


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4g} ms"


def _clock(seconds) -> str:
    if seconds is None:
        return "--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


class ProgressBar:
    """One status line on stderr: trials done, best (weighted) latency so far, time left."""

    def __init__(self, stream=None, width: int = 24):
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0

    def __call__(self, ev: dict) -> None:
        if ev["event"] == "confirm":
            if self.tty:
                self.stream.write("\n")
            self.stream.write(f"{ev['task']}: re-timing its {ev['configs'] - 1} best configuration(s) and the "
                              f"default in {ev['rounds']} interleaved rounds\n")
            self.stream.flush()
            return
        done, total = ev["done"], max(1, ev["total"])
        if ev["event"] == "done":
            self.stream.write(f"all {done} trials are in the log already (resumed); nothing to measure\n")
            return
        frac = min(1.0, done / total)
        fill = int(frac * self.width)
        line = (f"[{'#' * fill}{'.' * (self.width - fill)}] {done}/{total} trials | best {_ms(ev['best_total'])}"
                f" | {_clock(ev['elapsed'])} elapsed, {_clock(ev['eta'])} left")
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r" + line)
            if done >= total:
                self.stream.write("\n")
        elif done >= total or now - self._last >= 5.0 or done == ev.get("resumed", 0) + 1:
            self.stream.write(line + "\n")      # not a terminal: a line every few seconds
            self._last = now
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def plot_curve(curve, path: str, title: str = "") -> str | None:
    """Tuning curve (weighted sum of the best latencies vs trials) as a PNG; None when matplotlib is absent."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [c[0] for c in curve]
    ys = [c[1] * 1e3 for c in curve]
    ax.step(xs, ys, where="post")
    ax.set_xlabel("trials")
    ax.set_ylabel("model latency estimate (ms)\nsum of weight x best kernel")
    ax.set_title(title or "tvmfuse tuning curve")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def cmd_tune(args) -> int:
    from ..errors import InputError
    from ..target import parse_target
    from .measure import MeasureOptions
    from .search import TuneOptions, Tuner
    from .tasks import extract_tasks

    if args.trials < 1:
        raise InputError("--trials must be at least 1")
    if bool(args.tracker) != bool(args.key):
        raise InputError("--tracker and --key go together")
    if args.tracker and ":" not in args.tracker:
        raise InputError(f"--tracker must be HOST:PORT, got {args.tracker!r}")
    warm_logs = tuple(args.warm_start or ())
    for p in warm_logs:
        if not os.path.isfile(p):
            raise InputError(f"--warm-start {p}: no such file (a tuning log of other workloads is expected)")
    if args.warm_start_seeds < 0:
        raise InputError("--warm-start-seeds must be 0 or more")
    if args.confirm_top < 0 or args.confirm_rounds < 1:
        raise InputError("--confirm-top must be 0 or more and --confirm-rounds at least 1")
    target = parse_target(args.target)
    model = _model(args)
    tasks = extract_tasks(model, target)
    if not tasks:
        print("no kernel of this model matches a schedule template for this target; nothing to tune")
        return 0
    print(f"{len(tasks)} task(s) for {target.kind.name}"
          + (f" ({target.attrs['mcpu']})" if "mcpu" in target.attrs else "") + ":")
    for t in tasks:
        bucket = f"  bucket {t.bucket}" if t.bucket else ""
        print(f"  {t.name}  [{t.family}]{bucket}  x{t.weight}  space {t.space.size()}  workload {t.workload_key}")
    mo = MeasureOptions(tracker=args.tracker, key=args.key, build_timeout=args.build_timeout,
                        run_timeout=args.run_timeout)
    inputs = _kernel_inputs(args, model, tasks, target) if args.inputs else None
    bar = ProgressBar()
    tuner = Tuner(tasks, target, args.log, TuneOptions(trials=args.trials, batch=args.batch, seed=args.seed,
                                                       transfer_logs=warm_logs,
                                                       transfer_seeds=args.warm_start_seeds,
                                                       confirm_top=args.confirm_top,
                                                       confirm_rounds=args.confirm_rounds),
                  mo, progress=bar, inputs=inputs)
    result = tuner.run()
    bar.finish()
    ws = result.warm_start
    if warm_logs:
        print(f"warm start from {len(warm_logs)} log(s): cost model trained on {ws.get('records', 0)} records of "
              f"{ws.get('workloads', 0)} other workload(s); {ws.get('seeds', 0)} of their best configuration(s) "
              f"measured first")
    for msg in ws.get("skipped_lines", []):
        print(f"  {msg}")
    print(f"{result.trials_run} trials measured in {result.seconds:.1f} s "
          f"({result.trials_total} in the log for these kernels); records in {args.log}")
    for row in result.tasks:
        errs = ", ".join(f"{k} {v}" for k, v in sorted(row["errors"].items())) or "none"
        speed = (f"  {row['default'] / row['best']:.2f}x over default"
                 if row["best"] and row["default"] else "")
        conf = row.get("confirm")
        how = ""
        if conf is not None:
            how = (" (confirm rounds kept the default; the search's best was "
                   f"{_ms(row['searched_best'])} in one measurement)" if conf["chosen_is_default"]
                   else f" (confirmed in {conf['rounds']} interleaved rounds)")
        print(f"  {row['name']}: best {_ms(row['best'])} (default {_ms(row['default'])}){speed}{how}; "
              f"{row['trials']} trials, errors: {errs}")
    if args.plot != "none" and result.curve:
        png = args.plot or os.path.splitext(args.log)[0] + ".png"
        if plot_curve(result.curve, png, title=os.path.basename(args.model)) is None:
            print("matplotlib is not installed: no tuning-curve plot (pip install 'tvmfuse[plot]')")
        else:
            print(f"tuning curve: {png}")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    return 0


def _model(args):
    """The model to tune: the ONNX file with the ``--shape`` pins applied.  Kernels are measured at
    concrete sizes, so a symbolic dim left open is an InputError naming it."""
    from ..errors import InputError
    from ..frontend import parse_shape_args, read_model, specialize_inputs, symbolic_dims

    shapes = parse_shape_args(args.shape)
    model = read_model(args.model)
    if shapes:
        model = specialize_inputs(model, shapes)
    open_dims = symbolic_dims(model)
    if open_dims:
        raise InputError(f"{args.model} has symbolic dims {sorted(open_dims)}: tuning measures kernels at "
                         f"concrete sizes; pin them with --shape (e.g. --shape {sorted(open_dims)[0]}=1)")
    return model


def _kernel_inputs(args, model, tasks, target) -> dict:
    from .tasks import kernel_inputs_from_samples

    from ..feeds import load_feeds
    from ..frontend import read_model

    model = read_model(model)
    return kernel_inputs_from_samples(model, target, load_feeds(args.inputs, model), tasks)


def cmd_logs_show(args) -> int:
    from .log import summary

    target = None
    if args.target:
        from ..target import parse_target

        target = parse_target(args.target)
    rows = summary(args.logs, target, all_targets=target is None)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no measure records")
        return 0
    print(f"{'target':<44} {'workload':<18} {'kernel':<40} {'template':<22} {'trials':>6} {'errors':>6} {'best':>12}")
    for r in rows:
        wk = r["workload_key"] + (f"@{r['bucket']}" if r.get("bucket") else "")
        print(f"{r['target_key'][:44]:<44} {wk:<18} {r['name'][:40]:<40} {r['template'][:22]:<22} "
              f"{r['trials']:>6} {sum(r['errors'].values()):>6} {_ms(r['best']):>12}"
              + (" confirmed" if r.get("confirmed") else ""))
    return 0


def cmd_logs_merge(args) -> int:
    from .log import merge

    n = merge(args.logs, args.output, best_only=False)
    print(f"merged {len(args.logs)} log(s) into {args.output}: {n['records']} records, {n['workloads']} workloads"
          + (f", {n['skipped_lines']} unreadable line(s) skipped" if n["skipped_lines"] else ""))
    return 0


def cmd_logs_best(args) -> int:
    from .log import merge

    n = merge(args.logs, args.output, best_only=True)
    print(f"best record per workload and target of {len(args.logs)} log(s) written to {args.output}: "
          f"{n['records']} records")
    return 0


def add_commands(sub) -> None:
    from ..compiled import add_compile_options

    t = sub.add_parser("tune", help="tune the fused kernels of a model; records go to a JSON-lines log")
    add_compile_options(t, tuning_log=False)
    t.add_argument("--trials", type=int, required=True, help="measurements in all (the log's count)")
    t.add_argument("--log", required=True, help="tuning log (JSON lines); an existing one is resumed")
    t.add_argument("--tracker", default=None, help="HOST:PORT of a TVM RPC tracker to measure on")
    t.add_argument("--key", default=None, help="device key at the tracker")
    t.add_argument("--inputs", default=None, help=".npz of sample model inputs (default: normal random)")
    t.add_argument("--batch", type=int, default=8, help="configurations per round")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--warm-start", action="append", default=None, metavar="LOG",
                   help="tuning log of other workloads (other shapes, other models; repeatable): its records of "
                   "the same templates train the cost model first, and its best configurations that fit a "
                   "kernel's knob space are measured first; never taken as measurements of this model's kernels")
    t.add_argument("--warm-start-seeds", type=int, default=2,
                   help="best configurations per workload of the --warm-start logs measured first (0: none)")
    t.add_argument("--confirm-top", type=int, default=3,
                   help="at the end, re-time each kernel's N best configurations against its default in "
                   "interleaved rounds; one faster than the default in every round is what compiling applies, "
                   "else the default (0: off, the search's "
                   "single best measurement is applied)")
    t.add_argument("--confirm-rounds", type=int, default=3, help="interleaved rounds of that re-timing")
    t.add_argument("--build-timeout", type=float, default=60.0, help="seconds per candidate build")
    t.add_argument("--run-timeout", type=float, default=30.0, help="seconds per candidate run")
    t.add_argument("--plot", default=None, help="tuning-curve PNG (default: LOG.png; 'none' for no plot)")
    t.add_argument("--json", action="store_true", help="print the result as JSON")
    t.set_defaults(func=cmd_tune)

    lg = sub.add_parser("logs", help="inspect, merge or prune tuning logs")
    lsub = lg.add_subparsers(dest="logs_command", required=True)
    s = lsub.add_parser("show", help="one row per target and workload: trials, errors, best latency")
    s.add_argument("logs", nargs="+")
    s.add_argument("--target", default=None, help="only this target's records (default: all)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_logs_show)
    m = lsub.add_parser("merge", help="merge logs into one (all targets, exact duplicates dropped)")
    m.add_argument("logs", nargs="+")
    m.add_argument("-o", "--output", required=True)
    m.set_defaults(func=cmd_logs_merge)
    b = lsub.add_parser("best", help="keep the best record per workload and target")
    b.add_argument("logs", nargs="+")
    b.add_argument("-o", "--output", required=True)
    b.set_defaults(func=cmd_logs_best)
