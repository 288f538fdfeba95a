"""CUDA: elementwise / broadcast / layout groups (no reduction): one thread per ``vec`` outputs,
128-bit loads and stores where the innermost extent allows.

Matches a PrimFunc whose blocks are all spatial.  The glue is inlined into the output block(s); each
remaining block is flattened and split into (blockIdx.x, threadIdx.x, vector lanes).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ... import _compat as C
from ...analysis import ELEMWISE, INJECTIVE, nearest
from ..base import Config, KnobSpace, Match, knob
from ._common import CudaTemplate, arch_of, bind_elementwise, has_bool_buffer, inline_glue

THREADS = (64, 128, 256, 512, 1024)
VECTOR_LANES = (1, 2, 4)       # fp32 lanes; 4 = one 128-bit load per thread


@dataclass(frozen=True)
class ElementwiseConfig(Config):
    """The knobs of a flattened elementwise kernel."""

    threads: int = knob("threads per block")
    vec: int = knob("outputs per thread, loaded/stored as one vector")


class CudaElementwise(CudaTemplate, family="cuda_elementwise", config=ElementwiseConfig):
    def match_graph(self, g, func: C.PrimFunc, target: C.Target) -> Match | None:
        if not g.blocks or not all(b.is_spatial for b in g.blocks):
            return None
        outs = g.outputs
        if not outs:
            return None
        # every output's innermost extent bounds the vector width (vectors must not straddle rows)
        inner = [b.extents[-1] if b.extents else 1 for b in outs]
        total = min(prod(int(e) for e in b.extents) for b in outs)
        return Match(self.family, {"blocks": [b.name for b in g.blocks], "outputs": [b.name for b in outs],
                                   "inner": inner, "total": total, "bool": has_bool_buffer(g)})

    def accepts(self, group, target: C.Target) -> str | None:
        if not group.is_static():
            return "symbolic extents (the CUDA templates are built for static shapes)"
        other = [m for m in group.members if m.kind not in (ELEMWISE, INJECTIVE)]
        return f"{other[0].name} is a {other[0].kind}, not elementwise" if other else None

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        inner = match.info["inner"]
        lanes = [v for v in VECTOR_LANES if all(n % v == 0 for n in inner)]
        if match.info.get("bool"):
            # TVM 0.27's CUDA codegen writes 4 bools as a ushort4 (8 bytes for 4 one-byte elements) and
            # applies ``!`` to it, which nvcc rejects (deberta_v2's attention mask); bool kernels stay scalar
            lanes = [1]
        arch = arch_of(target)
        threads = [t for t in THREADS if t <= arch.max_threads_per_block]
        return ElementwiseConfig.space(threads=threads, vec=lanes)

    def default_config(self, match: Match, target: C.Target) -> dict:
        arch = arch_of(target)
        sp = self.space(match, target)
        lanes = sp.knobs[1].choices
        vec = max(v for v in lanes if v <= arch.ew_vec)
        # small tensors: fewer threads per block so that all SMs get a block
        per_block = max(64, match.info["total"] // max(1, vec * arch.sm_count))
        threads = nearest(sp.knobs[0].choices, min(arch.ew_threads, 1 << (per_block.bit_length() - 1)))
        return ElementwiseConfig(threads=threads, vec=vec).asdict()

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        cfg = ElementwiseConfig.from_dict(config)
        # Step 1. Inline the glue (broadcasts, reshapes, intermediate arithmetic) into the outputs.
        left = inline_glue(sch, match.info["blocks"], keep=set(match.info["outputs"]))
        # Step 2. Each remaining block (the outputs; an intermediate that is also an output stays):
        #         flatten, split into blocks x threads x lanes, vectorize the lanes.
        for name in left:
            bind_elementwise(sch, name, cfg.threads, cfg.vec)



