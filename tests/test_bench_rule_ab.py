"""benchmarks/rule_ab.py: the "before" build lacks exactly the named rules (and the rule table is restored
after it), the two builds' outputs are checked against each other, an unknown rule is refused by name.  No
timing is asserted (one round of one call, only to run the code path)."""
import importlib.util
import os

import numpy as np
import pytest

from tvmfuse.passes import rules as R

from test_fusion_rules_scale_prologue import se_block

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("rule_ab", os.path.join(_ROOT, "benchmarks", "rule_ab.py"))
A = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(A)


def test_before_build_lacks_the_rule_and_the_table_is_restored(rng):
    model = se_block(c=32, hw=8, out=16)
    table = R.RULES
    new, before = A.build(model), A.build(model, ("scale_prologue",))
    assert R.RULES is table
    assert before.kernel_count == new.kernel_count + 1, ([s["kernel"] for s in new.report.schedules],
                                                        [s["kernel"] for s in before.report.schedules])
    feeds = {"x": rng.standard_normal((1, 16, 8, 8)).astype(np.float32)}
    out = A.knob_ab.paired_ab({"new": new, "before": before}, feeds, rounds=1, number=1, extra={})
    assert out["ratio_new_over_before_median"] > 0


def test_unknown_rule_is_refused_by_name():
    with pytest.raises(SystemExit, match="no rule.*'no_such_rule'"):
        A.build(se_block(), ("no_such_rule",))
