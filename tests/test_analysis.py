"""The analysis layer (``tvmfuse.analysis``: block roles, multiply-accumulate operands, epilogue blocks,
reductions) on kernels the graph stage makes, and the typed configs of the template families
(``schedules.base.Config``: knob space from the fields, records keep plain JSON dicts)."""
import itertools
import json
import random
from dataclasses import dataclass

import pytest

from tvmfuse import analysis as A
from tvmfuse import models as M
from tvmfuse.schedules.base import Config, Exclusion, knob
from tvmfuse.schedules.cpu import matmul as MM
from tvmfuse.schedules.cuda import TEMPLATES
from test_schedules_cuda import FAMILY_CASES, cuda, family_kernel, fused_funcs


def _kernel_with(funcs, kinds):
    """The one fused kernel whose block graph has a block of iteration kinds ``kinds``."""
    found = [(n, f) for n, f in funcs.items()
             if (g := A.block_graph(f)) is not None and any(b.kinds == kinds for b in g.blocks)]
    assert len(found) == 1, (kinds, sorted(funcs))
    return found[0]


def test_block_roles_and_contraction_operands_of_matmul_epilogue():
    funcs = fused_funcs(M.matmul_bias_gelu(m=16, k=24, n=32), cuda())
    _, func = _kernel_with(funcs, "SSR")
    g = A.block_graph(func)
    mm = next(b for b in g.blocks if b.kinds == "SSR")
    assert mm.is_reduction and not mm.is_spatial and mm.extents == (16, 32, 24)
    a, b = A.multiply_accumulate(mm.stmt)
    assert [len(x.indices) for x in (a, b)] == [2, 2] and not a.source.same_as(b.source)
    # the epilogue (bias, GELU) follows the contraction; the last block writes the output
    assert g.consumers[mm.name] and not mm.is_output and g.blocks[-1].is_output
    assert all(b.is_spatial for b in g.blocks if b is not mm)
    assert A.analyze_reductions(func) == (True, A.analyze_reductions(func)[1]) and A.reduced_axes(func) == 1


def test_row_reductions_are_not_contractions():
    funcs = fused_funcs(M.layernorm_softmax(rows=8, d=32), cuda())
    for func in funcs.values():
        g = A.block_graph(func)
        if g is None or not any(b.is_reduction for b in g.blocks):
            continue
        contraction, keys = A.analyze_reductions(func)
        assert not contraction and keys
        assert all(A.multiply_accumulate(b.stmt) is None for b in g.blocks if b.is_reduction
                   and not _is_square(b))


def _is_square(block):
    """x*x summed (a variance) is a multiply-accumulate of one buffer with itself."""
    mac = A.multiply_accumulate(block.stmt)
    return mac is not None and mac[0].source.same_as(mac[1].source)


def test_coef_reads_the_stride_of_a_conv_window():
    funcs = fused_funcs(M.conv_bn_relu_residual(channels=8, size=10), cuda())
    _, func = _kernel_with(funcs, "SSSSRRR")
    conv = next(b for b in A.block_graph(func).blocks if b.kinds == "SSSSRRR")
    loads = A.multiply_accumulate(conv.stmt)
    data = next(ld for ld in loads if any(len(v) > 1 for v in A.index_vars(ld.indices)))
    ivs = [iv.var for iv in conv.stmt.iter_vars]
    assert A.coef(data.indices[2], ivs[2]) == 1 and A.coef(data.indices[2], ivs[5]) == 1
    assert A.coef(data.indices[2], ivs[3]) == 0


def test_nearest_prefers_the_smaller_on_ties():
    assert A.nearest((4, 8, 16), 12) == 8 and A.nearest((4, 8, 16), 13) == 16 and A.nearest((1, 3), 2) == 1


# ----------------------------------------------------------------------------- typed configs
@dataclass(frozen=True)
class _Tile(Config):
    rows: int = knob("rows per tile")
    cols: int = knob("columns per tile")


def test_config_space_from_fields_and_json_round_trip():
    space = _Tile.space(rows=(1, 2), cols=[4, 8])
    assert space.names == ["rows", "cols"] and space.knobs[0].doc == "rows per tile"
    assert space.knobs[1].choices == (4, 8)
    cfg = _Tile(rows=2, cols=8)
    back = _Tile.from_dict(json.loads(json.dumps(cfg.asdict())))
    assert back == cfg and space.contains(cfg.asdict())


@pytest.mark.parametrize("bad", [{"rows": 1}, {"rows": 1, "cols": 4, "depth": 2}])
def test_config_from_a_dict_of_other_knobs_names_them(bad):
    with pytest.raises(ValueError, match="does not name the knobs"):
        _Tile.from_dict(bad)


def test_config_space_needs_choices_for_every_field():
    with pytest.raises(ValueError, match=r"choices missing for \['cols'\]"):
        _Tile.space(rows=(1,))
    with pytest.raises(ValueError, match=r"not knobs: \['depth'\]"):
        _Tile.space(rows=(1,), cols=(1,), depth=(2,))


def _tall_wide(rows, cols):
    return f"{rows}x{cols} too big" if rows * cols > 8 else None


def test_exclusions_take_configs_out_of_every_view_of_the_space():
    """size, contains, sample, all_configs and neighbors agree: the product less the excluded combinations."""
    space = _Tile.space(rows=(1, 2, 4), cols=(2, 4, 8), exclusions=(Exclusion(("rows", "cols"), _tall_wide),))
    legal = [dict(rows=r, cols=c) for r, c in itertools.product((1, 2, 4), (2, 4, 8)) if r * c <= 8]
    assert space.size() == len(legal) == 6 and list(space.all_configs()) == legal
    assert list(space.all_configs(limit=2)) == legal[:2]
    assert not space.contains({"rows": 4, "cols": 4}) and space.contains({"rows": 4, "cols": 2})
    assert space.excluded({"rows": 2, "cols": 8}) == "2x8 too big"
    rnd = random.Random(0)
    assert {tuple(space.sample(rnd).values()) for _ in range(200)} == {(c["rows"], c["cols"]) for c in legal}
    # (4, 4) and (2, 8) are excluded
    assert space.neighbors({"rows": 2, "cols": 4}) == [{"rows": 1, "cols": 4}, {"rows": 2, "cols": 2}]


def test_exclusion_naming_other_knobs_or_leaving_nothing_is_an_error():
    with pytest.raises(ValueError, match=r"reads knobs \['depth'\]"):
        _Tile.space(rows=(1,), cols=(1,), exclusions=(Exclusion(("rows", "depth"), _tall_wide),))
    space = _Tile.space(rows=(4,), cols=(4,), exclusions=(Exclusion(("rows", "cols"), _tall_wide),))
    assert space.size() == 0
    with pytest.raises(ValueError, match="no config outside its exclusions.*4x4 too big"):
        space.sample(random.Random(0))


def test_predicated_register_tiles_over_the_bound_are_not_in_the_space():
    """A predicated tile (pad_n False, N not a multiple of nr) of more than MAX_PREDICATED_TILE_LANES lanes per
    unrolled k step is excluded (31 s to build); the padded tile, a tile that divides every N, and the
    predicated tile at the bound stay."""
    ex = MM.predicated_tile_exclusion([43, 64])
    cap = MM.MAX_PREDICATED_TILE_LANES
    assert ex.check(mr=7, nvec=2, lanes=16, k_unroll=8, pad_n=False) is not None     # 1792 lanes, 43 % 32
    assert ex.check(mr=7, nvec=2, lanes=16, k_unroll=8, pad_n=True) is None
    assert ex.check(mr=cap // 32, nvec=2, lanes=16, k_unroll=1, pad_n=False) is None  # at the bound
    assert ex.check(mr=cap // 32 + 1, nvec=2, lanes=16, k_unroll=1, pad_n=False) is not None
    assert MM.predicated_tile_exclusion([64, 96]).check(mr=8, nvec=2, lanes=16, k_unroll=8, pad_n=False) is None


@pytest.mark.parametrize("family", list(FAMILY_CASES))
def test_cuda_families_declare_typed_configs(family):
    """Every CUDA family's space is its config's fields; its default is a plain dict of them."""
    target = cuda()
    _, _, (template, match) = family_kernel(family, target)
    assert template.config_type is not None and issubclass(template.config_type, Config)
    space = template.space(match, target)
    assert space.names == template.config_type.knob_names()
    default = template.default_config(match, target)
    assert type(default) is dict and space.contains(default)
    assert template.config_type.from_dict(default).asdict() == default


def test_every_cuda_template_is_typed():
    assert all(t.config_type is not None and t.target_kinds == ("cuda",) and t.family for t in TEMPLATES)
