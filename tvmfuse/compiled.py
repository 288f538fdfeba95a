"""``tvmfuse.compile``: a model in, a runnable compiled model (with its fusion report) out."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace

import numpy as np

from . import _compat as C
from .errors import InputError
from .explain import Recorder
from .pipeline import (PipelineOptions, fusion_passes, grouping_passes, guarded, legalize_passes,
                       lowering_passes, pre_legalize_passes, schedule_passes)
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


def _relax_io(mod) -> tuple[list[TensorSpec], list[TensorSpec]]:
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


def validate_feeds(feeds: dict, inputs: list[TensorSpec]) -> list[np.ndarray]:
    """Feeds in parameter order, or an InputError naming the input and what is wrong with it."""
    if not isinstance(feeds, dict):
        raise InputError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
    names = [i.name for i in inputs]
    unknown = sorted(set(feeds) - set(names))
    if unknown:
        raise InputError(f"unknown input name(s) {unknown}; the model's inputs are {names}")
    missing = [n for n in names if n not in feeds]
    if missing:
        raise InputError(f"missing input(s) {missing}; the model's inputs are {names}")
    arrays = []
    for spec in inputs:
        a = np.asarray(feeds[spec.name])
        if str(a.dtype) != spec.dtype:
            raise InputError(f"input {spec.name!r} has dtype {a.dtype}, the model expects {spec.dtype}")
        if a.ndim != len(spec.shape) or any(isinstance(d, int) and d != s for d, s in zip(spec.shape, a.shape)):
            raise InputError(f"input {spec.name!r} has shape {list(a.shape)}, the model expects "
                             f"{list(spec.shape)}")
        arrays.append(np.ascontiguousarray(a))
    return arrays


def _to_numpy(value) -> list[np.ndarray]:
    if hasattr(value, "numpy"):
        return [value.numpy()]
    out = []
    for v in value:
        out.extend(_to_numpy(v))
    return out


class CompiledModel:
    """A compiled model: ``run(feeds) -> {output name: array}``, its kernel count and fusion report."""

    def __init__(self, executable, target, inputs, outputs, report: FusionReport, fused_mod, options,
                 source_model=None):
        self.executable = executable
        self.target = target
        self.inputs: list[TensorSpec] = inputs
        self.outputs: list[TensorSpec] = outputs
        self.report = report
        self.fused_module = fused_mod
        self.options = options
        self.source_model = source_model
        self.device = C.device_for(target)
        self._vm = None

    @property
    def kernel_count(self) -> int:
        """Kernel launches per inference."""
        return self.report.kernels_after

    @property
    def vm(self):
        if self._vm is None:
            self._vm = C.VirtualMachine(self.executable, self.device)
        return self._vm

    def run(self, feeds: dict) -> dict[str, np.ndarray]:
        arrays = validate_feeds(feeds, self.inputs)
        args = [C.tensor(a, self.device) for a in arrays]
        result = self.vm["main"](*args)
        values = _to_numpy(result)
        return {spec.name: v for spec, v in zip(self.outputs, values)}

    def benchmark(self, feeds: dict, repeat: int = 10, warmup: int = 2) -> float:
        """Median wall time of one inference in seconds (inputs already on the device)."""
        arrays = validate_feeds(feeds, self.inputs)
        args = [C.tensor(a, self.device) for a in arrays]
        f = self.vm["main"]
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

    def export(self, path: str, **kwargs) -> str:
        from .export import export

        return export(self, path, **kwargs)


def compile(model, target=None, tuning_log: str | None = None, *, name: str | None = None,  # noqa: A001
            num_threads: int | None = None, **option_overrides) -> CompiledModel:
    """Compile an ONNX path / ModelProto or a Relax IRModule with tvmfuse's pipeline.

    ``tuning_log``: None (every kernel gets its template's untuned default for ``target``), ``"shipped"``
    (the records shipped in ``tuning_logs/``), or the path of a tuning log.
    ``option_overrides`` are fields of ``PipelineOptions`` (fusion, schedules, fast_math).
    """
    tgt = parse_target(target)
    if not is_gpu(tgt):
        configure_threads(num_threads)
    options = replace(PipelineOptions(tuning_log=tuning_log), **option_overrides)
    from .frontend import load_onnx, onnx_io, read_model

    source = None
    if isinstance(model, C.IRModule):
        mod = model
        inputs, outputs = _relax_io(mod)
        name = name or "IRModule"
    else:
        source = read_model(model)
        mod = load_onnx(source)
        ins, outs = onnx_io(source)
        r_in, r_out = _relax_io(mod)
        inputs = [TensorSpec(o["name"], r.shape, r.dtype) for o, r in zip(ins, r_in)]
        outputs = [TensorSpec(o["name"], r.shape, r.dtype) for o, r in zip(outs, r_out)]
        name = name or (os.path.basename(os.fspath(model)) if isinstance(model, (str, os.PathLike))
                        else (source.graph.name or "model"))
    with tgt:
        unfused = C.Sequential(legalize_passes(tgt), name="tvmfuse.unfused_view")(mod)
        with Recorder() as rec:
            legal = C.Sequential(pre_legalize_passes(tgt, options) + legalize_passes(tgt),
                                 name="tvmfuse.pre_fusion")(mod)
            fused = C.Sequential(fusion_passes(tgt, options), name="tvmfuse.fusion")(legal)
            rest = C.Sequential(schedule_passes(tgt, options) + lowering_passes(tgt), name="tvmfuse.lowering")
            ex = C.compile_module(fused, tgt, relax_pipeline=rest)
        # the grouping alone, run again outside the recorder, only to list the groups in the report
        grouped = guarded(grouping_passes(tgt, options), "grouping")(legal)
        report = FusionReport(model=name, target=str(tgt.kind.name) + (f" ({tgt.attrs['mcpu']})"
                              if "mcpu" in tgt.attrs else ""),
                              before=graph_stats(unfused), after=graph_stats(fused),
                              groups=fused_groups(grouped), refused=list(rec.refused),
                              schedules=list(rec.schedules))
    return CompiledModel(ex, tgt, inputs, outputs, report, fused, options, source_model=source)
