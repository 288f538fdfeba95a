"""CUDA: multi-output sibling kernels (Q/K/V projections of one input, several heads' outputs): a
PrimFunc whose outputs come from independent chains that only share function inputs.

Matches when every chain (connected component of the block graph) is a matmul + epilogue of the same
shape, or an elementwise group.  Each matmul sibling gets the matmul template's tiling with one shared
config (the siblings have one shape, so one tuned config serves all); each elementwise sibling gets the
elementwise template's flatten + vectorize.  Each sibling is its own launch inside the one PrimFunc
(one Relax call); the shared input is read once per sibling, from L2 after the first.
"""
from __future__ import annotations

from ... import _compat as C
from ..base import KnobSpace, Match, Template
from ._common import bind_elementwise, block_graph, inline_glue
from .elementwise import VECTOR_LANES
from .matmul import CudaMatmul

_MATMUL = CudaMatmul()
EW_THREADS = 256


class CudaSiblings(Template):
    family = "cuda_siblings"
    target_kinds = ("cuda",)

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        g = block_graph(func)
        if g is None:
            return None
        comps = g.components()
        if len(comps) < 2:
            return None
        parts, shape = [], None
        for names in comps:
            blocks = [g.by_name(n) for n in names]
            if not any(b.is_output for b in blocks):
                return None                        # dead chain: not a sibling
            if all(b.is_spatial for b in blocks):
                outs = [b for b in blocks if b.is_output]
                lanes = max(v for v in VECTOR_LANES if all((b.extents[-1] if b.extents else 1) % v == 0
                                                           for b in outs))
                parts.append({"kind": "elementwise", "blocks": names,
                              "outputs": [b.name for b in outs], "vec": lanes})
                continue
            m = _MATMUL.match_blocks(g, names)
            if m is None:
                return None
            key = (m.info["batch_size"], m.info["m"], m.info["n"], m.info["k"])
            if shape is not None and key != shape:
                return None                        # one config must be legal for every sibling
            shape = key
            parts.append({"kind": "matmul", **m.info})
        if shape is None:
            return None                            # all elementwise: the elementwise template's case
        return Match(self.family, {"parts": parts})

    def _first_matmul(self, match: Match) -> Match:
        info = next(p for p in match.info["parts"] if p["kind"] == "matmul")
        return Match(_MATMUL.family, {k: v for k, v in info.items() if k != "kind"})

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        return _MATMUL.space(self._first_matmul(match), target)

    def default_config(self, match: Match, target: C.Target) -> dict:
        return _MATMUL.default_config(self._first_matmul(match), target)

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        for part in match.info["parts"]:
            if part["kind"] == "matmul":
                # Step 1. A matmul sibling: the matmul template's tiles, staging and epilogue.
                _MATMUL.apply(sch, Match(_MATMUL.family, {k: v for k, v in part.items() if k != "kind"}),
                              config)
            else:
                # Step 2. An elementwise sibling: inline its glue, flatten, vectorize.
                for name in inline_glue(sch, part["blocks"], keep=set(part["outputs"])):
                    bind_elementwise(sch, name, EW_THREADS, part["vec"])
