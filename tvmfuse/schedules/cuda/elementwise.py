"""CUDA: elementwise / broadcast / layout groups (no reduction): one thread per ``vec`` outputs,
128-bit loads and stores where the innermost extent allows.

Matches a PrimFunc whose blocks are all spatial.  The glue is inlined into the output block(s); each
remaining block is flattened and split into (blockIdx.x, threadIdx.x, vector lanes).
"""
from __future__ import annotations

from ... import _compat as C
from ..base import Knob, KnobSpace, Match, Template
from ._common import arch_of, bind_elementwise, block_graph, inline_glue, nearest

THREADS = (64, 128, 256, 512, 1024)
VECTOR_LANES = (1, 2, 4)       # fp32 lanes; 4 = one 128-bit load per thread


class CudaElementwise(Template):
    family = "cuda_elementwise"
    target_kinds = ("cuda",)

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        g = block_graph(func)
        if g is None or not g.blocks or not all(b.is_spatial for b in g.blocks):
            return None
        outs = g.outputs
        if not outs:
            return None
        # every output's innermost extent bounds the vector width (vectors must not straddle rows)
        inner = [b.extents[-1] if b.extents else 1 for b in outs]
        total = min(_prod(b.extents) for b in outs)
        return Match(self.family, {"blocks": [b.name for b in g.blocks], "outputs": [b.name for b in outs],
                                   "inner": inner, "total": total})

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        inner = match.info["inner"]
        lanes = [v for v in VECTOR_LANES if all(n % v == 0 for n in inner)]
        arch = arch_of(target)
        threads = [t for t in THREADS if t <= arch.max_threads_per_block]
        return KnobSpace((
            Knob("threads", tuple(threads), "threads per block"),
            Knob("vec", tuple(lanes), "outputs per thread, loaded/stored as one vector"),
        ))

    def default_config(self, match: Match, target: C.Target) -> dict:
        arch = arch_of(target)
        sp = self.space(match, target)
        lanes = sp.knobs[1].choices
        vec = max(v for v in lanes if v <= arch.ew_vec)
        # small tensors: fewer threads per block so that all SMs get a block
        per_block = max(64, match.info["total"] // max(1, vec * arch.sm_count))
        threads = nearest(sp.knobs[0].choices, min(arch.ew_threads, 1 << (per_block.bit_length() - 1)))
        return {"threads": threads, "vec": vec}

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        # Step 1. Inline the glue (broadcasts, reshapes, intermediate arithmetic) into the outputs.
        left = inline_glue(sch, match.info["blocks"], keep=set(match.info["outputs"]))
        # Step 2. Each remaining block (the outputs; an intermediate that is also an output stays):
        #         flatten, split into blocks x threads x lanes, vectorize the lanes.
        for name in left:
            bind_elementwise(sch, name, config["threads"], config["vec"])


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n



