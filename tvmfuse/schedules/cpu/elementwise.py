"""Elementwise / injective / broadcast kernels (no reduction at all) on CPUs.

Matches a PrimFunc whose blocks are all spatial.  The chain is folded into its output block(s) (one
pass over memory, no intermediate), each output's loops are fused into one, split into
[parallel outer][unrolled][vector lanes]; what does not fill a group of vectors runs as a short tail
(scalars: common.partition_tail), so the main loop never stores a partial vector.
Default knob values come from the target (``template_defaults`` in schedules/cpu_targets.json).
"""
from __future__ import annotations

from ... import _compat as C
from ...target import cpu_info, template_defaults
from ..base import Knob, KnobSpace, Match, Template
from . import common as U

UNROLL = (1, 2, 4, 8)          # vectors per iteration of the innermost scalar loop
VECTOR_MULT = (1, 2)           # vector lanes = target lanes x this (2: two registers per step)
PARALLEL = (True, False)       # parallel outer loop (False: small kernels where a fork costs more)
FAMILY = "cpu.elementwise"     # its defaults (vector_mult, unroll, min_vectors_per_core, ...): the target table


class Elementwise(Template):
    family = FAMILY
    target_kinds = ("llvm",)

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        sch = C.Schedule(func)
        left = U.inline_elementwise(sch)
        blocks = [sch.get_sblock(n) for n in left]
        if not blocks or not all(U.is_spatial(sch, b) for b in blocks):
            return None
        if any(U.has_shift(sch, b) for b in blocks):
            return None   # conformance node/test_bitshift_*_shift_ge_width: see common.has_shift
        sizes = []
        for b in blocks:
            extents = U.loop_extents(sch, b)
            total = 1
            for e in extents:
                total *= max(e, 1)
            sizes.append(-1 if -1 in extents else total)   # -1: a symbolic extent (batch, seq)
        return Match(self.family, {"blocks": left, "elements": -1 if -1 in sizes else max(sizes)})

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        return KnobSpace((
            Knob("lanes", (cpu_info(target).float32_lanes,), "float32 lanes per vector (target)"),
            Knob("vector_mult", VECTOR_MULT, "vector registers per step"),
            Knob("unroll", UNROLL, "steps unrolled per loop iteration"),
            Knob("parallel", PARALLEL, "parallel outer loop"),
        ))

    def default_config(self, match: Match, target: C.Target) -> dict:
        info = cpu_info(target)
        d = template_defaults(target, FAMILY)
        lanes = info.float32_lanes
        if match.info["elements"] < 0:   # symbolic size: any batch/sequence, so split it over the cores
            return {"lanes": lanes, "vector_mult": 1, "unroll": 1, "parallel": True}
        vectors = match.info["elements"] // lanes
        unroll = d["unroll"] if vectors >= d["unroll_min_vectors_per_core"] * info.cores else 1
        # Below min_vectors_per_core vector iterations per core a parallel fork costs more than it saves.
        return {"lanes": lanes, "vector_mult": U.nearest_choice(VECTOR_MULT, d["vector_mult"]),
                "unroll": U.nearest_choice(UNROLL, unroll),
                "parallel": vectors >= d["min_vectors_per_core"] * info.cores}

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        # Step 1. Fold the chain into its outputs.
        U.inline_elementwise(sch)
        # Step 2. Each remaining block: fused loops, [parallel][unroll][vector].
        for name in match.info["blocks"]:
            U.schedule_injective(sch, sch.get_sblock(name), config["lanes"] * config["vector_mult"],
                                 unroll=config["unroll"], parallel=config["parallel"])
