"""``tvmfuse.compile``: a model in, a runnable compiled model (with its fusion report) out."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace

import numpy as np

from . import _compat as C
from .io import Executes, validate_feeds  # noqa: F401  (validate_feeds: imported from here before)
from .errors import InputError
from .explain import Recorder
from .pipeline import (PipelineOptions, Stages, check_upper_bounds, takes_element_aligned_args,
                       upper_bounds_of)
from .report import FusionReport, fused_groups, graph_stats
from .target import configure_threads, is_gpu, parse_target

log = logging.getLogger("tvmfuse")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple
    dtype: str

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


def relax_io(mod) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The input and output specs of a Relax module's ``main``."""
    main = mod["main"]
    ins = []
    for p in main.params:
        s = C.type_of(p)
        shape = tuple(int(d) if isinstance(d, C.IntImm) else str(d) for d in s.shape.values)
        ins.append(TensorSpec(C.var_name(p), shape, str(s.dtype)))
    ret = C.ret_type(main)
    fields = ret.fields if isinstance(ret, C.TupleType) else [ret]
    outs = []
    for i, s in enumerate(fields):
        shape = tuple(int(d) if isinstance(d, C.IntImm) else str(d) for d in s.shape.values) \
            if getattr(s, "shape", None) is not None and isinstance(s.shape, C.relax.ShapeExpr) else ()
        outs.append(TensorSpec(f"output{i}", shape, str(getattr(s, "dtype", "float32"))))
    return ins, outs


def symbolic_dims(inputs: list[TensorSpec]) -> dict[str, list[dict]]:
    """Each symbolic dim of the inputs (``batch``) -> the places it sizes ({"input", "axis"})."""
    out: dict[str, list[dict]] = {}
    for spec in inputs:
        for axis, d in enumerate(spec.shape):
            if isinstance(d, str):
                out.setdefault(d, []).append({"input": spec.name, "axis": axis})
    return out


class CompiledModel(Executes):
    """A compiled model: ``run(feeds, outputs=None) -> {output name: array}`` (no copies, see tvmfuse.io),
    ``bind(feeds)`` for inputs kept on the device across runs, its kernel count and fusion report."""

    def __init__(self, executable, target, inputs, outputs, report: FusionReport, fused_mod, options,
                 source_model=None, shape_upper_bounds: dict | None = None):
        self.executable = executable
        self.target = target
        self.inputs: list[TensorSpec] = inputs
        self.outputs: list[TensorSpec] = outputs
        self.report = report
        self.fused_module = fused_mod
        self.options = options
        self.source_model = source_model
        self.device = C.device_for(target)
        # the kernels assume element-size alignment of their arguments: numpy inputs are read in place
        self.element_aligned_args = bool(getattr(options, "element_aligned_args", False)) \
            and takes_element_aligned_args(target)
        # symbolic dim -> the largest size run() takes (the memory plan's bound; an InputError above it)
        self.shape_upper_bounds: dict = dict(shape_upper_bounds or {})
        self._vm = None
        self._main_fn = None
        self._align_numpy()

    @property
    def kernel_count(self) -> int:
        """Kernel launches per inference."""
        return self.report.kernels_after

    @property
    def vm(self):
        if self._vm is None:
            self._vm = C.VirtualMachine(self.executable, self.device)
        return self._vm

    def _main(self):
        if self._main_fn is None:
            self._main_fn = self.vm["main"]
        return self._main_fn

    def benchmark(self, feeds: dict, repeat: int = 10, warmup: int = 2) -> float:
        """Median wall time of one inference in seconds (inputs already on the device)."""
        args = [self._to_device(v)[0] for v in validate_feeds(feeds, self.inputs, self.shape_upper_bounds)]
        f = self._main()
        for _ in range(warmup):
            f(*args)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            r = f(*args)
            if is_gpu(self.target):
                self.device.sync()
            times.append(time.perf_counter() - t0)
            del r
        return float(np.median(times))


def compile(model, target=None, tuning_log: str | None = None, *, name: str | None = None,  # noqa: A001
            num_threads: int | None = None, input_shapes: dict | None = None,
            **option_overrides) -> CompiledModel:
    """Compile an ONNX path / ModelProto or a Relax IRModule with tvmfuse's pipeline.

    ``input_shapes`` pins shapes before import: ``{"x": [1, 128]}`` (an input) or ``{"batch": 8}`` (a
    symbolic dim of the inputs); dims left symbolic compile to kernels that take any size.
    ``tuning_log``: None (every kernel gets its template's untuned default for ``target``), ``"shipped"``
    (the records shipped in ``tuning_logs/``), or the path of a tuning log.
    ``option_overrides`` are fields of ``PipelineOptions`` (fusion, attention, schedules, fast_math,
    ``shape_upper_bounds={"batch": 64}``: memory planned once for sizes up to the bound, larger ones an
    InputError from run(); an unknown dim name is an InputError here).
    """
    tgt = parse_target(target)
    if not is_gpu(tgt):
        configure_threads(num_threads)
    options = replace(PipelineOptions(tuning_log=tuning_log), **option_overrides)
    from .frontend import load_onnx, onnx_io, read_model

    source = None
    if isinstance(model, C.IRModule):
        if input_shapes:
            raise InputError("input_shapes applies to ONNX models; an IRModule's shapes are fixed by its "
                             "function signature")
        mod = model
        inputs, outputs = relax_io(mod)
        name = name or "IRModule"
    else:
        source = read_model(model)
        mod = load_onnx(source, input_shapes=input_shapes)
        ins, outs = onnx_io(source)
        r_in, r_out = relax_io(mod)
        inputs = [TensorSpec(o["name"], r.shape, r.dtype) for o, r in zip(ins, r_in)]
        outputs = [TensorSpec(o["name"], r.shape, r.dtype) for o, r in zip(outs, r_out)]
        name = name or (os.path.basename(os.fspath(model)) if isinstance(model, (str, os.PathLike))
                        else (source.graph.name or "model"))
    # the bounds the model gives (an IRModule's tir_var_upper_bound) and the user's, checked against its dims
    bounds = {**upper_bounds_of(mod["main"]),
              **check_upper_bounds(options.shape_upper_bounds, set(symbolic_dims(inputs)))}
    with tgt:
        stages = Stages(tgt, options)
        unfused = C.Sequential(stages.unfused_view(), name="tvmfuse.unfused_view")(mod)
        with Recorder() as rec:
            fused = C.Sequential(stages.graph(), name="tvmfuse.graph")(mod)
            rest = C.Sequential(stages.schedule() + stages.lower(), name="tvmfuse.lowering")
            ex = C.compile_module(fused, tgt, relax_pipeline=rest)
        report = FusionReport(model=name, target=str(tgt.kind.name) + (f" ({tgt.attrs['mcpu']})"
                              if "mcpu" in tgt.attrs else ""),
                              before=graph_stats(unfused, fold_constant_calls=True), after=graph_stats(fused),
                              groups=fused_groups(rec.groups), refused=list(rec.refused),
                              schedules=list(rec.schedules))
    return CompiledModel(ex, tgt, inputs, outputs, report, fused, options, source_model=source,
                         shape_upper_bounds=bounds)


# --------------------------------------------------------------------------- command-line options
TARGET_HELP = "target (default: this host's CPU; 'aarch64', 'cuda', a target string or JSON)"


SHAPE_BOUND_HELP = ("the largest size of a symbolic dimension (batch=64; repeatable): memory is planned once "
                    "for it, a larger input is refused. Default: no bound, storage sized per call")


def add_compile_options(parser, model_help: str = "ONNX file", tuning_log: bool = True,
                        shape_bound: bool = False) -> None:
    """The options of every command that compiles a model (``compile``, ``run``, ``report``, ``export``,
    ``tune``, ``explain``): the model, ``--target``, ``--tuning-log`` (unless ``tuning_log`` is False: a
    command that makes or ignores records) and ``--shape NAME=DIMS`` (repeatable; ``input_shapes_of``);
    with ``shape_bound`` (commands that build a model to run: compile, run, export) ``--shape-bound
    NAME=N`` (repeatable; ``shape_bounds_of``)."""
    from .frontend import SHAPE_HELP
    from .records import TUNING_LOG_HELP

    parser.add_argument("model", help=model_help)
    parser.add_argument("--target", default=None, help=TARGET_HELP)
    if tuning_log:
        parser.add_argument("--tuning-log", default=None, help=TUNING_LOG_HELP)
    parser.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS", help=SHAPE_HELP)
    if shape_bound:
        parser.add_argument("--shape-bound", action="append", default=[], metavar="NAME=N", help=SHAPE_BOUND_HELP)


def input_shapes_of(args) -> dict | None:
    """``input_shapes`` for ``compile`` from the parsed ``--shape`` options (None when none)."""
    from .frontend import parse_shape_args

    return parse_shape_args(getattr(args, "shape", None)) or None


def shape_bounds_of(args) -> dict | None:
    """``shape_upper_bounds`` for ``compile`` from the parsed ``--shape-bound`` options (None when none)."""
    from .frontend import parse_shape_args

    out = {}
    for name, dims in parse_shape_args(getattr(args, "shape_bound", None), option="--shape-bound").items():
        if len(dims) != 1:
            raise InputError(f"--shape-bound {name}={','.join(map(str, dims))}: give one size per symbolic dim "
                             "(NAME=N)")
        out[name] = dims[0]
    return out or None
