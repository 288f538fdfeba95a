"""The ``tvmfuse`` command line.  Bad input prints one line naming the cause and exits non-zero."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time

import numpy as np

from .feeds import load_feeds as _load_feeds

from .compiled import add_compile_options, input_shapes_of, shape_bounds_of
from .errors import InputError
from .records import TUNING_LOG_HELP

# Modules that add their own subcommands: each has ``add_commands(subparsers)``.
_COMMAND_MODULES = ["tvmfuse.explain_cli", "tvmfuse.tune.cli", "tvmfuse.export"]


def _random_feeds_pinned(inputs, shapes: dict, seed: int = 0) -> dict:
    """Random feeds for an artifact's inputs with their symbolic dims sized by ``--shape`` (dim or input)."""
    from .errors import InputError

    sizes = {k: v[0] for k, v in shapes.items() if len(v) == 1}
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in inputs:
        shape = list(shapes.get(spec.name) or [sizes.get(d, d) if isinstance(d, str) else d for d in spec.shape])
        if len(shape) != len(spec.shape) or any(not isinstance(d, int) for d in shape):
            raise InputError(f"input {spec.name!r} has shape {list(spec.shape)}; --shape gives no size for "
                             f"{[d for d in shape if not isinstance(d, int)] or 'its rank'}")
        feeds[spec.name] = (rng.standard_normal(shape) if np.issubdtype(np.dtype(spec.dtype), np.floating)
                            else rng.integers(0, 2, size=shape)).astype(spec.dtype)
    return feeds


def _save_outputs(outputs: dict, path: str | None) -> None:
    if path:
        np.savez(path, **outputs)
        print(f"outputs written to {path}")
    for name, v in outputs.items():
        flat = v.reshape(-1)
        print(f"{name}: shape {list(v.shape)} dtype {v.dtype} first {np.array2string(flat[:4], precision=5)}")


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(target=args.target, json_out=args.json, small=args.quick, tuning_log=args.tuning_log)


def cmd_compile(args) -> int:
    import tvmfuse

    t0 = time.perf_counter()
    cm = tvmfuse.compile(args.model, target=args.target, tuning_log=args.tuning_log,
                         input_shapes=input_shapes_of(args), shape_upper_bounds=shape_bounds_of(args))
    dt = time.perf_counter() - t0
    out = args.output
    tvmfuse.export(cm, out)
    print(cm.report.table())
    print(f"compiled in {dt:.1f} s; artifact written to {out}")
    return 0


def cmd_run(args) -> int:
    import tvmfuse

    if os.path.isdir(args.model) or args.model.endswith(".tar"):
        if shape_bounds_of(args):
            raise InputError(f"--shape-bound applies when compiling; the artifact {args.model} was built with "
                             "its bounds (manifest: shape_upper_bounds)")
        runner = tvmfuse.load(args.model)
        shapes = input_shapes_of(args)
        if args.inputs:
            feeds = _load_feeds(args.inputs, None)
        elif shapes:
            feeds = _random_feeds_pinned(runner.inputs, shapes)
        else:
            feeds = runner.random_feeds()
        outputs = runner.run(feeds)
    else:
        from .frontend import read_model, specialize_inputs

        model = read_model(args.model)
        shapes = input_shapes_of(args)
        if shapes:
            model = specialize_inputs(model, shapes)
        cm = tvmfuse.compile(model, target=args.target, tuning_log=args.tuning_log,
                             shape_upper_bounds=shape_bounds_of(args))
        outputs = cm.run(_load_feeds(args.inputs, model))
    _save_outputs(outputs, args.output)
    return 0


def cmd_report(args) -> int:
    import tvmfuse

    cm = tvmfuse.compile(args.model, target=args.target, tuning_log=args.tuning_log,
                         input_shapes=input_shapes_of(args))
    print(cm.report.to_json() if args.json else cm.report.table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .version import __version__

    p = argparse.ArgumentParser(prog="tvmfuse", description="Operation fusion for Apache TVM.")
    p.add_argument("--version", action="version", version=f"tvmfuse {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log fusion and schedule decisions")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="compile the built-in example models, check them, print the report")
    d.add_argument("--target", default=None, help="target (default: this host's CPU)")
    d.add_argument("--json", action="store_true", help="print the reports as JSON")
    d.add_argument("--quick", action="store_true", help="smaller models")
    d.add_argument("--tuning-log", default=None, help=TUNING_LOG_HELP)
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("compile", help="compile an ONNX model into a deployable artifact")
    add_compile_options(c, shape_bound=True)
    c.add_argument("-o", "--output", required=True, help="artifact directory, or a .tar file")
    c.set_defaults(func=cmd_compile)

    r = sub.add_parser("run", help="run an ONNX model or an exported artifact on inputs from a .npz")
    add_compile_options(r, model_help="ONNX file or artifact (directory or .tar)", shape_bound=True)
    r.add_argument("--inputs", default=None, help=".npz with one array per input (default: random normal)")
    r.add_argument("-o", "--output", default=None, help="write the outputs to this .npz")
    r.set_defaults(func=cmd_run)

    rp = sub.add_parser("report", help="print the fusion report of a model")
    add_compile_options(rp)
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(func=cmd_report)

    for name in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        mod.add_commands(sub)
    return p


def main(argv=None) -> int:
    from .errors import TvmfuseError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except TvmfuseError as e:
        print(f"tvmfuse: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tvmfuse: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
