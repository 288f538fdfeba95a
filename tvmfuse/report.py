"""What fusion did: kernels, intermediate tensors and the memory traffic between kernels, before/after.

Definitions (the tests compute them by hand on small graphs):
- a *kernel* is one call of a compiled function from a Relax function (``call_tir``, ``call_tir_inplace``,
  ``call_dps_packed``): one launch per inference;
- an *intermediate* is a tensor that one kernel writes and at least one other kernel reads; its
  *traffic* is one write plus one read per reading kernel, in bytes.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

import numpy as np

from . import _compat as C

# Energy of moving one byte between DRAM and the chip: 640 pJ per 32-bit DRAM access (45 nm), from
# M. Horowitz, "Computing's energy problem (and what we can do about it)", ISSCC 2014, as tabulated in
# S. Han et al., "Learning both Weights and Connections for Efficient Neural Networks", NeurIPS 2015.
DRAM_PJ_PER_BYTE = 640.0 / 4
DRAM_PJ_SOURCE = "Horowitz, ISSCC 2014 (640 pJ per 32-bit DRAM access, 45 nm)"

_KERNEL_OPS = ("relax.call_tir", "relax.call_tir_inplace", "relax.call_dps_packed", "relax.call_tir_with_grad")


def _sinfo_bytes(sinfo) -> int:
    """Bytes of a tensor struct info with static shape; 0 where the shape is symbolic."""
    if isinstance(sinfo, C.TupleType):
        return sum(_sinfo_bytes(f) for f in sinfo.fields)
    if not isinstance(sinfo, C.TensorType) or sinfo.shape is None:
        return 0
    shape = sinfo.shape
    if not isinstance(shape, C.relax.ShapeExpr):
        return 0
    n = 1
    for d in shape.values:
        if not isinstance(d, C.IntImm):
            return 0
        n *= int(d.value)
    return n * np.dtype(str(sinfo.dtype)).itemsize if str(sinfo.dtype) not in ("bool",) else n


def _is_kernel_call(expr) -> bool:
    return isinstance(expr, C.relax.Call) and isinstance(expr.op, C.Op) and expr.op.name in _KERNEL_OPS


def _static_shape(sinfo) -> bool:
    if isinstance(sinfo, C.TupleType):
        return all(_static_shape(f) for f in sinfo.fields)
    return isinstance(sinfo, C.TensorType) and isinstance(sinfo.shape, C.relax.ShapeExpr) and \
        all(isinstance(d, C.IntImm) for d in sinfo.shape.values)


def _is_constant_call(expr, sinfo, folded: set) -> bool:
    """A ``call_tir`` that FoldConstant evaluates at compile time: every argument a constant or a var in
    ``folded``, a static output shape (``sinfo``), no symbolic shape arguments."""
    if not (isinstance(expr, C.relax.Call) and isinstance(expr.op, C.Op) and expr.op.name == "relax.call_tir"):
        return False
    if len(expr.args) > 2 or not _static_shape(sinfo):     # tir_vars, or a symbolic output shape
        return False
    return all(isinstance(a, C.Constant) or (isinstance(a, C.relax.Var) and a in folded) for a in _call_args(expr))


def _callee_name(call) -> str:
    callee = call.args[0]
    return str(callee.name_hint) if isinstance(callee, C.GlobalVar) else str(callee)


def _graph_functions(mod):
    """Relax functions that run at inference (not the Primitive group functions before FuseTIR)."""
    for gv, func in mod.functions.items():
        if isinstance(func, C.relax.Function) and not (func.attrs and "Primitive" in func.attrs):
            yield str(gv.name_hint), func


def _bindings(func):
    body = func.body
    if isinstance(body, C.relax.SeqExpr):
        for block in body.blocks:
            yield from block.bindings


@dataclass
class GraphStats:
    kernels: int
    intermediates: int
    intermediate_bytes: int
    traffic_bytes: int
    kernel_names: list[str]


def _call_args(call) -> list:
    return list(call.args[1].fields) if isinstance(call.args[1], C.relax.Tuple) else [call.args[1]]


def graph_stats(mod, fold_constant_calls: bool = False) -> GraphStats:
    """Count kernels and the intermediates between them in every inference function of ``mod``.
    ``fold_constant_calls``: a ``call_tir`` whose every argument is a constant (or the result of such a
    call) is not counted, as TVM's FoldConstant would have replaced it by its value (``Stages.unfused_view``:
    the count without building those calls)."""
    kernels, names = 0, []
    inter_count = inter_bytes = traffic = 0
    for _, func in _graph_functions(mod):
        producer: dict = {}       # relax var -> (kernel index, bytes)
        tuple_fields: dict = {}   # tuple var -> [(kernel index, bytes) per field]
        readers: dict = {}        # relax var -> set of kernel indices that read it
        folded: set = set()       # relax vars FoldConstant would make constants (fold_constant_calls)
        for b in _bindings(func):
            v, e = b.var, b.value
            if fold_constant_calls and _is_constant_call(e, C.type_of(v), folded):
                folded.add(v)
            elif fold_constant_calls and isinstance(e, (C.relax.TupleGetItem, C.relax.Var)) and \
                    (e.tuple_value if isinstance(e, C.relax.TupleGetItem) else e) in folded:
                folded.add(v)
            elif _is_kernel_call(e):
                k = kernels
                kernels += 1
                names.append(_callee_name(e))
                args = e.args[1].fields if isinstance(e.args[1], C.relax.Tuple) else [e.args[1]]
                for a in args:
                    if isinstance(a, C.relax.Var) and a in producer:
                        readers.setdefault(a, set()).add(k)
                sinfo = C.type_of(v)
                if isinstance(sinfo, C.TupleType):
                    tuple_fields[v] = [(k, _sinfo_bytes(f)) for f in sinfo.fields]
                else:
                    producer[v] = (k, _sinfo_bytes(sinfo))
            elif isinstance(e, C.relax.TupleGetItem) and e.tuple_value in tuple_fields:
                producer[v] = tuple_fields[e.tuple_value][int(e.index)]
            elif isinstance(e, C.relax.Var) and e in producer:
                producer[v] = producer[e]
        seen = {}
        for var, ks in readers.items():
            k, nbytes = producer[var]
            key = (k, id(var))
            others = {r for r in ks if r != k}
            if others and key not in seen:
                seen[key] = True
                inter_count += 1
                inter_bytes += nbytes
                traffic += nbytes * (1 + len(others))
    return GraphStats(kernels, inter_count, inter_bytes, traffic, names)


_SUFFIX = re.compile(r"\d+$")

# Where a kernel's schedule came from (the ``source`` of a schedule record) -> the name the report counts
# it under: a template's target default, a tuned record, dlight's rules, the generic CPU schedule.
SCHEDULE_SOURCES = {"default": "template", "tuned": "tuned", "fallback": "fallback (dlight)",
                    "generic": "generic", "unscheduled": "unscheduled"}


def schedule_source_counts(schedules: list[dict]) -> dict[str, int]:
    """Kernels per schedule source, every source listed (0 where none); an unknown source is counted
    under its own name."""
    counts = {v: 0 for v in SCHEDULE_SOURCES.values()}
    for s in schedules:
        key = SCHEDULE_SOURCES.get(s.get("source", ""), s.get("source", "unknown"))
        counts[key] = counts.get(key, 0) + 1
    return counts


def op_name(prim_func_name: str) -> str:
    """The op a legalized PrimFunc computes, from its name ("tir_exp3" -> "exp", "add1" -> "add")."""
    name = _SUFFIX.sub("", prim_func_name).rstrip("_")
    return name[4:] if name.startswith("tir_") else name


def groups_in(grouped_mod) -> list[dict]:
    """The groups of a grouped module (its Primitive functions, before FuseTIR) with their member ops."""
    groups = []
    for gv, func in grouped_mod.functions.items():
        if isinstance(func, C.PrimFunc) and func.attrs is not None and "tvmfuse.rule" in func.attrs:
            # a kernel a multi-node rule made before legalization (attention): its ops are recorded on it
            ops = json.loads(str(func.attrs["tvmfuse.ops"])) if "tvmfuse.ops" in func.attrs else []
            groups.append({"kernel": str(gv.name_hint), "ops": ops, "rule": str(func.attrs["tvmfuse.rule"]),
                           "outputs": 1})
            continue
        if not (isinstance(func, C.relax.Function) and func.attrs and "Primitive" in func.attrs):
            continue
        members = [op_name(_callee_name(b.value)) for b in _bindings(func)
                   if _is_kernel_call(b.value)]
        rule = str(func.attrs["tvmfuse.rule"]) if "tvmfuse.rule" in func.attrs else "fuse_ops"
        groups.append({"kernel": str(gv.name_hint), "ops": members, "rule": rule,
                       "outputs": len(C.ret_type(func).fields)
                       if isinstance(C.ret_type(func), C.TupleType) else 1,
                       **({"template": str(func.attrs["tvmfuse.template"])} if "tvmfuse.template" in func.attrs
                          else {})})
    groups.sort(key=lambda g: g["kernel"])
    return groups


def fused_groups(recorded: list[dict]) -> list[dict]:
    """The report's list of groups, from what the fusion pass recorded (``Recorder.groups``), by kernel."""
    return sorted((dict(g) for g in recorded), key=lambda g: g["kernel"])


@dataclass
class FusionReport:
    """Per model: kernels and intermediate bytes before/after tvmfuse, the groups, the refusals."""

    model: str
    target: str
    before: GraphStats
    after: GraphStats
    groups: list[dict] = field(default_factory=list)
    refused: list[dict] = field(default_factory=list)
    schedules: list[dict] = field(default_factory=list)

    @property
    def kernels_before(self) -> int:
        return self.before.kernels

    @property
    def kernels_after(self) -> int:
        return self.after.kernels

    @property
    def traffic_removed_bytes(self) -> int:
        return self.before.traffic_bytes - self.after.traffic_bytes

    @property
    def energy_saved_uj(self) -> float:
        return self.traffic_removed_bytes * DRAM_PJ_PER_BYTE * 1e-6

    def to_dict(self) -> dict:
        d = {
            "model": self.model,
            "target": self.target,
            "before": asdict(self.before),
            "after": asdict(self.after),
            "traffic_removed_bytes": self.traffic_removed_bytes,
            "energy_saved_uJ_per_inference": round(self.energy_saved_uj, 3),
            "energy_model": {"pj_per_dram_byte": DRAM_PJ_PER_BYTE, "source": DRAM_PJ_SOURCE},
            "groups": self.groups,
            "refused": self.refused,
            "schedules": self.schedules,
            "schedule_sources": schedule_source_counts(self.schedules),
        }
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self) -> str:
        def mb(n):
            return f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"

        rows = [
            f"tvmfuse fusion report: {self.model}  [{self.target}]",
            f"{'':24}{'before':>14}{'after':>14}",
            f"{'kernels':24}{self.before.kernels:>14}{self.after.kernels:>14}",
            f"{'intermediate tensors':24}{self.before.intermediates:>14}{self.after.intermediates:>14}",
            f"{'intermediate bytes':24}{mb(self.before.intermediate_bytes):>14}{mb(self.after.intermediate_bytes):>14}",
            f"{'memory traffic':24}{mb(self.before.traffic_bytes):>14}{mb(self.after.traffic_bytes):>14}",
            f"traffic removed: {mb(self.traffic_removed_bytes)} per inference, about "
            f"{self.energy_saved_uj:.2f} uJ of DRAM energy ({DRAM_PJ_PER_BYTE:.0f} pJ/byte, {DRAM_PJ_SOURCE})",
        ]
        if self.groups:
            rows.append(f"fused groups ({len(self.groups)}):")
            for g in self.groups:
                outs = f", {g['outputs']} outputs" if g.get("outputs", 1) > 1 else ""
                rows.append(f"  {g['kernel']}: {' + '.join(g['ops'])}  [{g['rule']}{outs}]")
        if self.schedules:
            counts = schedule_source_counts(self.schedules)
            rows.append("schedules: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
            for s in self.schedules:
                buckets = (s.get("knobs") or {}).get("buckets")    # one nest per size bucket (schedules.buckets)
                per = " [" + ", ".join(f"{b['bucket']}: {b['source']}" for b in buckets) + "]" if buckets else ""
                rows.append(f"  {s.get('kernel')}: {s.get('template')} ({s.get('source', '')}){per}")
        if self.refused:
            rows.append(f"refused fusions ({len(self.refused)}):")
            for r in self.refused:
                rows.append(f"  {r.get('producer')} -> {r.get('consumer')}: {r.get('reason')}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()
