"""Elementwise / injective / broadcast kernels (no reduction at all) on CPUs.

Matches a PrimFunc whose blocks are all spatial.  The chain is folded into its output block(s) (one
pass over memory, no intermediate), each output's loops are fused into one, split into
[parallel outer][unrolled][vector lanes]; what does not fill a group of vectors runs as a short tail
(scalars: common.partition_tail), so the main loop never stores a partial vector.
Knobs: a typed ``ElementwiseConfig``; default values come from the target (``cpu_info``) and the family's
``template_defaults`` in schedules/cpu_targets.json.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from ... import _compat as C
from ...analysis import ELEMWISE, INJECTIVE
from ...target import cpu_info
from ..base import Config, KnobSpace, Match, knob
from ..buckets import BatchBuckets, shape_vars, symbolic_division, symbolic_workspace
from . import common as U

UNROLL = (1, 2, 4, 8)          # vectors per iteration of the innermost scalar loop
VECTOR_MULT = (1, 2)           # vector lanes = target lanes x this (2: two registers per step)
FAMILY = "cpu.elementwise"     # its defaults (vector_mult, unroll, unroll_min_vectors_per_core): the target table


@dataclass(frozen=True)
class ElementwiseConfig(Config):
    """The knobs of ``cpu.elementwise``: [parallel outer][unrolled steps][vector lanes x vector_mult]."""

    lanes: int = knob("float32 lanes per vector (target)")
    vector_mult: int = knob("vector registers per step", VECTOR_MULT)
    unroll: int = knob("steps unrolled per loop iteration", UNROLL)
    parallel: bool = U.parallel_knob()


class Elementwise(BatchBuckets, U.CpuTemplate, family=FAMILY, config=ElementwiseConfig):
    def _keep_rule(self, sch: C.Schedule, target: C.Target) -> list | None:
        """For a kernel over symbolic extents, [min reuse, typical symbol size] of the rule that keeps a
        producer in memory instead of folding it (``reused_producer``); None for a static kernel (tables of
        constants were folded before scheduling)."""
        if not any(-1 in U.loop_extents(sch, b) for b in U.top_blocks(sch)):
            return None
        d = self.table_defaults(target)
        return [int(d["keep_reuse_min"]), int(d["typical_symbol_size"])]

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        sch = C.Schedule(func)
        keep = self._keep_rule(sch, target)
        kept_names: set[str] = set()
        left = U.inline_elementwise(sch, keep_if=keep_if_reused(keep, kept_names))
        blocks = [sch.get_sblock(n) for n in left]
        if not blocks or not all(U.is_spatial(sch, b) for b in blocks):
            return None
        if any(U.has_shift(sch, b) for b in blocks):
            return None   # conformance node/test_bitshift_*_shift_ge_width: see common.has_shift
        # a chain whose fold into its outputs repeats a large subexpression per use (deberta_v2_dyn's
        # relative-position buckets: a log bucket read by several wheres and gathers, ~10^4 operations per
        # output element) is left to the generic schedule, which keeps such producers in memory; folded,
        # TVM's simplifier ran for over 20 minutes on its indices (benchmarks/notes/corpus11.md)
        limit = self.table_defaults(target)["max_folded_ops"]
        folded = max((U.count_ops(U.store_value(sch, b)) for b in blocks
                      if U.store_value(sch, b) is not None), default=0)
        if folded > limit:
            return None
        sizes = []
        for b in blocks:
            extents = U.loop_extents(sch, b)
            total = 1
            for e in extents:
                total *= max(e, 1)
            sizes.append(-1 if -1 in extents else total)   # -1: a symbolic extent (batch, seq)
        # the producers the rule kept: their nests run serial (Step 2)
        kept = sorted(kept_names & set(left))
        info = {"blocks": left, "elements": -1 if -1 in sizes else max(sizes), "keep_reused": keep, "kept": kept}
        # the kept producers (each at most 1 / keep_reuse_min of a consumer, serial) do not size the buckets:
        # deberta_v2_dyn's [2 * S] table has no covering product with its [b * 4, S, S] outputs, and without
        # buckets its s1 call forked the pool for every nest (+5 us; notes/relpos17.md)
        split = [_static_and_symbolic(sch, b) for n, b in zip(left, blocks) if n not in kept]
        covering = _covering_extent([batch for _, batch in split])
        if covering is not None:
            # outputs over symbolic extents that one of them covers (one output; gpt2's Q/K/V head split,
            # [batch x sequence] x 64 each; llama's rotary kernel: cos/sin over [sequence] x 16 next to the
            # rotated Q/K over [batch x sequence] x 64): size buckets over the covering product
            # (BatchBuckets), a serial nest while the elements of all outputs (at most their static parts'
            # sum x the covering product) stay under the target's fork/join cost (the static default's rule)
            static = sum(st for st, _ in split)
            info.update(batch=covering, elements_per_batch=static,
                        serial_batches_work=U.serial_batches(static, target))
        return Match(self.family, info)

    def wants_unit_nest(self, match: Match, target: C.Target, func: C.PrimFunc, scheduled: C.PrimFunc) -> bool:
        """Over symbolic extents, when the table's ``unit_nest`` is on and the scheduled kernel allocates a
        buffer of symbolic size (a kept producer: a run-time workspace per call) or the kernel's own indices
        divide by a symbolic extent (a reshape over the sequence; not the divisions of this schedule's fused
        loops, which every symbolic kernel has): at every shape variable 1 both are static.  deberta_v2_dyn at
        b1 s1: its Q/K/V head copies 0.20 -> 0.05 us a call, its relative-position kernel 0.29 -> 0.15
        (notes/unit24.md)."""
        return bool(self.table_defaults(target).get("unit_nest")) and bool(shape_vars(func)) and \
            (symbolic_workspace(scheduled) or symbolic_division(func))

    # ------------------------------------------------------------------ size buckets (BatchBuckets)
    def batch_info(self, match: Match, batch: int) -> dict:
        return {"bucket_elements": match.info["elements_per_batch"] * batch}

    def accepts(self, group, target: C.Target) -> str | None:
        """Elementwise, broadcast and layout ops only (static or symbolic extents), none computing an integer
        shift (``common.has_shift``: left to the generic schedule)."""
        other = [m for m in group.members if m.kind not in (ELEMWISE, INJECTIVE)]
        if other:
            return f"{other[0].name} is a {other[0].kind}, not an elementwise or layout op"
        shifts = [m for m in group.members if m.func is not None and U.func_shifts(m.func)]
        if shifts:
            return f"{shifts[0].name} shifts integers (not scheduled: a shift by the bit width is undefined)"
        return None

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        return ElementwiseConfig.space(lanes=(cpu_info(target).float32_lanes,))

    def default_config(self, match: Match, target: C.Target) -> dict:
        info, d = cpu_info(target), self.table_defaults(target)
        lanes = info.float32_lanes
        if match.info["elements"] < 0:
            # symbolic size: any batch/sequence, so split it over the cores; a split of an unknown extent is
            # predicated, one vector per step (nothing to unroll into whole vectors)
            # (a size bucket: serial under the fork/join cost at its elements, common.parallel_default)
            work = match.info.get("bucket_elements")
            return ElementwiseConfig(lanes=lanes, vector_mult=1, unroll=1,
                                     parallel=U.parallel_default(work, target)).asdict()
        vectors = match.info["elements"] // lanes
        unroll = d["unroll"] if vectors >= d["unroll_min_vectors_per_core"] * info.cores else 1
        # Below the target's fork/join cost (common.parallel_default, on the elements) the kernel runs serial.
        return ElementwiseConfig(lanes=lanes, vector_mult=U.nearest_choice(VECTOR_MULT, d["vector_mult"]),
                                 unroll=U.nearest_choice(UNROLL, unroll),
                                 parallel=U.parallel_default(match.info["elements"], target)).asdict()

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        cfg = ElementwiseConfig.from_dict(config)
        # Step 1. Fold the chain into its outputs (over symbolic extents: a producer many consumer elements
        # reuse, a table computed at run time, stays in memory: ``reused_producer``).
        U.inline_elementwise(sch, keep_if=keep_if_reused(match.info.get("keep_reused")))
        # Step 2. Each remaining block: fused loops, [parallel][unroll][vector].  A producer kept in memory
        # runs serial: it is keep_reuse_min times smaller than its consumer, and a parallel loop of its own
        # would fork and join the pool once more (deberta_v2_dyn at s1: three [2, S] tables, +6 us).
        kept = set(match.info.get("kept", ()))
        for name in match.info["blocks"]:
            U.schedule_injective(sch, sch.get_sblock(name), cfg.lanes * cfg.vector_mult, unroll=cfg.unroll,
                                 parallel=cfg.parallel and name not in kept)


def typical_elements(sch: C.Schedule, block, typical: int) -> int:
    """A block's loop-domain size with every symbolic extent taken as ``typical`` (a size to compare
    domains by, not a bound)."""
    n = 1
    for e in U.loop_extents(sch, block):
        n *= typical if e < 0 else max(e, 1)
    return n


def reused_producer(sch: C.Schedule, block, consumers, min_reuse: int, typical: int) -> bool:
    """Whether to keep ``block`` (a spatial producer) in memory rather than fold it into ``consumers``:
    it is not a cheap copy (``common.is_cheap``) and a consumer's domain is at least ``min_reuse`` times its
    own at typical sizes, so folding would recompute each of its values that many times.
    deberta_v2_dyn's relative-position buckets: a log bucket over [2, S] and an index over [S, S], folded into
    per-head [b*4, S, S] gathers, recomputed the log 4 x S / 2 times per value (notes/relpos17.md)."""
    if U.is_cheap(sch, block):
        return False
    own = typical_elements(sch, block, typical)
    return any(typical_elements(sch, c, typical) >= min_reuse * own for c in consumers)


def keep_if_reused(rule: list | None, kept: set | None = None):
    """``inline_elementwise``'s ``keep_if`` for a ``_keep_rule`` (None: fold everything); the names of the
    blocks it keeps are added to ``kept`` when given."""
    if rule is None:
        return None
    min_reuse, typical = rule

    def keep_if(sch, block, consumers) -> bool:
        keep = reused_producer(sch, block, consumers, min_reuse, typical)
        if keep and kept is not None:
            kept.add(U.block_name(sch, block))
        return keep

    return keep_if


def _factors(expr) -> list[str]:
    """The factors of a product of extents (``batch * sequence``: ["batch", "sequence"]), as text."""
    if isinstance(expr, C.tirx.Mul):
        return _factors(expr.a) + _factors(expr.b)
    return [str(expr)]


def _covering_extent(batches: list):
    """Of the symbolic parts of the outputs' extents (None: an output with static extents only, the empty
    product), the one every other divides (its factors a sub-multiset of that one's, so it is never larger:
    extents are >= 1), or None (no symbolic extent at all, or two products neither of which covers the
    other: ``batch`` and ``sequence``)."""
    batches = [b for b in batches if b is not None]
    if not batches:
        return None
    counts = [collections.Counter(_factors(b)) for b in batches]
    for b, c in zip(batches, counts):
        if all(not (other - c) for other in counts):
            return b
    return None


def _static_and_symbolic(sch: C.Schedule, block) -> tuple[int, object]:
    """The product of a block's static loop extents and of its symbolic ones (None: none symbolic)."""
    static, batch = 1, None
    for loop in sch.get_loops(block):
        ext = sch.get(loop).extent
        if isinstance(ext, C.tirx.IntImm):
            static *= int(ext)
        else:
            batch = ext if batch is None else batch * ext
    return static, batch
