"""Cumulative scans on CPUs (``cpu.scan``): the kernels TVM's ``topi.cumsum`` / ``topi.cumprod`` make (Relax
``cumsum`` / ``cumprod``; ONNX ``CumSum``: RoBERTa's position ids ``cumsum(ids != pad)``, OPT's positions from
the attention mask).

TVM legalizes a scan to an extern kernel: one opaque block (no iterators, no root block) holding
``for row in parallel(rows): out[first] = x[first]; for k in range(length - 1): out[k+1] = out[k] op x[k+1]``
(``rows`` = the product of the other axes).  No schedule primitive applies to it (a block without iterators,
its loops inside it), so every other family and the generic schedule refused it and it ran "unscheduled":
always forked, whatever its size (a 1 x 32 cumsum forked for 32 additions).

This family recognises that nest (``scan_nest``: a recurrence store that reads the output it writes, under a
serial loop, under the row loop) and rewrites its loops instead of scheduling blocks (``rewrite``, which
``schedule_with`` calls for a template that defines it):

1. the row loop is parallel only when the scan's work (rows x length additions) is over the target's
   fork/join cost (``common.parallel_default``: knob ``parallel``), else serial;
2. over a symbolic extent (``batch``, ``sequence``: the work is known at run time only) ``parallel`` gives
   two nests of the scan in one kernel, branched on rows x length (``schedules.buckets.join_buckets``):
   serial up to the fork/join cost, the parallel row loop above it (the generic schedule's rule).

The recurrence itself stays serial (each element needs the one before it); what each step computes is
TVM's (the same stores, same order, so results are bit-identical).
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...target import cpu_info
from ..base import Config, KnobSpace, Match
from . import common as U

FAMILY = "cpu.scan"


@dataclass(frozen=True)
class ScanConfig(Config):
    """The knob of ``cpu.scan``: whether the row loop forks (over symbolic extents: above the fork/join
    cost only)."""

    parallel: bool = U.parallel_knob()


def _extent(e) -> int:
    return int(e) if isinstance(e, C.tirx.IntImm) else -1


def _stores(stmt) -> list:
    out = []
    C.post_order_visit(stmt, lambda n: out.append(n) if isinstance(n, C.tirx.BufferStore) else None)
    return out


def _loads_of(expr, buf) -> int:
    found = []
    C.post_order_visit(expr, lambda n: found.append(n) if isinstance(n, C.TensorLoad) and n.source.same_as(buf)
                       else None)
    return len(found)


def scan_nest(func: C.PrimFunc) -> dict | None:
    """The parts of TVM's scan kernel in ``func``: ``{"block", "rows", "step"}`` (the opaque block's
    realize, the row loop, the serial recurrence loop), or None when ``func`` is not one.

    The shape checked: the body is one block without iterators whose body is a loop over rows holding
    exactly two statements, a store to the output (the first element) and a serial loop whose only store
    writes the output from a value that loads the output (the recurrence)."""
    realize = func.body
    if not isinstance(realize, C.SBlockRealize):
        return None
    block = realize.block
    if block.iter_vars or block.alloc_buffers or block.match_buffers or str(block.name_hint) == "root":
        return None
    rows = block.body
    if not isinstance(rows, C.tirx.For):
        return None
    seq = rows.body
    parts = list(seq.seq) if isinstance(seq, C.tirx.SeqStmt) else []
    if len(parts) != 2 or not isinstance(parts[0], C.tirx.BufferStore) or not isinstance(parts[1], C.tirx.For):
        return None
    first, step = parts
    if int(step.kind) != int(C.ForKind.SERIAL) or not isinstance(step.body, C.tirx.BufferStore):
        return None
    out = func.params[-1] if func.params else None      # the output (TVM's convention: the last parameter)
    rec = step.body
    if out is None or not first.buffer.same_as(out) or not rec.buffer.same_as(out) or \
            _loads_of(rec.value, out) != 1 or len(_stores(rows)) != 2:
        return None
    return {"block": realize, "rows": rows, "step": step}


class Scan(U.CpuTemplate, family=FAMILY, config=ScanConfig):
    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        nest = scan_nest(func)
        if nest is None:
            return None
        rows, length = _extent(nest["rows"].extent), _extent(nest["step"].extent)
        length = length + 1 if length >= 0 else -1
        work = rows * length if rows >= 0 and length >= 0 else -1
        # over symbolic extents: the largest work a serial nest takes (0: none, the row loop always parallel;
        # a 1-core target never forks)
        serial_up_to = U.min_parallel_work(target) - 1 if work < 0 and cpu_info(target).cores > 1 else 0
        return Match(self.family, {"rows": rows, "length": length, "work": work, "serial_up_to": serial_up_to,
                                   "op": str(nest["block"].block.name_hint)})

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        return ScanConfig.space()

    def default_config(self, match: Match, target: C.Target) -> dict:
        work = match.info["work"]
        # symbolic: True (a serial nest under the fork/join cost is in the kernel, see ``rewrite``)
        return ScanConfig(parallel=True if work < 0 else U.parallel_default(work, target)).asdict()

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        raise TypeError("cpu.scan rewrites the kernel's loops (Scan.rewrite): its block has no iterators for "
                        "schedule primitives")

    def rewrite(self, func: C.PrimFunc, match: Match, config: dict) -> C.PrimFunc:
        """Step 1 / 2 of the module docstring: the scan with its row loop parallel or serial, or both under a
        run-time branch on rows x length when the work is symbolic and ``parallel`` is on."""
        cfg = ScanConfig.from_dict(config)
        nest = scan_nest(func)
        if nest is None:
            raise ValueError("cpu.scan: the kernel is not TVM's scan nest (scan_nest found none)")
        if not cfg.parallel:
            return _with_rows(func, nest, C.ForKind.SERIAL)
        if match.info["work"] >= 0:
            return _with_rows(func, nest, C.ForKind.PARALLEL)
        from ..buckets import Bucket, join_buckets

        bound = match.info["serial_up_to"]
        if bound < 1:
            return _with_rows(func, nest, C.ForKind.PARALLEL)
        work = nest["rows"].extent * (nest["step"].extent + 1)
        nests = [_with_rows(func, nest, k, root=True) for k in (C.ForKind.SERIAL, C.ForKind.PARALLEL)]
        return join_buckets(nests, (Bucket(f"work<={bound}", bound), Bucket(f"work>{bound}", None)), work)


def _with_rows(func: C.PrimFunc, nest: dict, kind, root: bool = False) -> C.PrimFunc:
    """``func`` with its row loop of ``kind`` and fresh loop variables (two nests of one kernel must not
    share them); ``root``: the block renamed "root" (``join_buckets`` joins root blocks)."""
    rows, step = nest["rows"], nest["step"]
    fresh = {rows.loop_var: C.tirx.Var(str(rows.loop_var.name), rows.loop_var.ty),
             step.loop_var: C.tirx.Var(str(step.loop_var.name), step.loop_var.ty)}

    def swap(v):
        return fresh.get(v, v)

    body = C.structural_map(rows.body, (C.tirx.Var, swap))
    loop = C.tirx.For(fresh[rows.loop_var], rows.min, rows.extent, kind, body)
    block = nest["block"].block
    name = "root" if root else str(block.name_hint)
    new = C.SBlock([], [], [], name, loop)
    return func.with_body(C.SBlockRealize([], True, new))
