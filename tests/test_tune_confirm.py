"""The tuner's confirm rounds: at the end of a job the search's best configurations are re-timed against
the default in interleaved rounds, and the winner there (a ``confirm`` record) is what compiling applies.
A lucky single measurement is not applied, a candidate that crashes or computes wrong numbers in the
rounds is never chosen, and a later, better search result is applied until a new confirm covers it."""
import json

import numpy as np
import pytest

import tvmfuse
from tvmfuse.records import confirmed_choice
from tvmfuse.tune import TuneOptions, Tuner, task_for
from tvmfuse.tune import log as L
from tvmfuse.tune.measure import Measurer
from tvmfuse.tune.search import choose_confirmed

from test_tune import FAST, Faulty, SplitVec, scale_add_func


@pytest.fixture(scope="module")
def measurer():
    m = Measurer(tvmfuse.host_target(), FAST)
    yield m
    m.close()


def _lines(path):
    return [json.loads(x) for x in open(path) if x.strip()]


def _confirms(path):
    return [r for r in _lines(path) if r["type"] == "confirm"]


def _rewrite_costs(path, config, costs):
    """Give the measure record of ``config`` other costs (a lucky measurement, made by hand)."""
    out = []
    for r in _lines(path):
        if r["type"] == "measure" and r["config"] == config:
            r["costs"], r["error"] = costs, None
        out.append(json.dumps(r))
    path.write_text("\n".join(out) + "\n")


def test_choose_confirmed_needs_every_round_default_otherwise_errors_never():
    d = {"k": 0}
    a, b = {"k": 1}, {"k": 2}
    err = {"kind": "crash", "message": "x"}
    # a lower median but slower than the default in one round (the round a lucky median hides): the default
    assert choose_confirmed([{"config": a, "costs": [3.0, 1.0, 2.0]}, {"config": d, "costs": [2.5, 2.5, 2.5]}],
                            d) == d
    # faster in every round: the candidate, however small the margin
    assert choose_confirmed([{"config": a, "costs": [2.4, 2.4, 2.4]}, {"config": d, "costs": [2.5, 2.5, 2.5]}],
                            d) == a
    # of two that beat the default in every round, the least median, not the first or the least minimum
    assert choose_confirmed([{"config": a, "costs": [1.0, 2.3, 2.3]}, {"config": b, "costs": [2.0, 2.0, 2.0]},
                             {"config": d, "costs": [2.5, 2.5, 2.5]}], d) == b
    # a tie in one round is not faster
    assert choose_confirmed([{"config": a, "costs": [2.0]}, {"config": d, "costs": [2.0]}], d) == d
    # the default failed in the rounds: the least median of those that ran; a failed one is never chosen
    assert choose_confirmed([{"config": a, "costs": None, "error": err}, {"config": b, "costs": [9.0]},
                             {"config": d, "costs": None, "error": err}], d) == b
    assert choose_confirmed([{"config": a, "costs": None, "error": err}, {"config": b, "costs": [9.0]},
                             {"config": d, "costs": [10.0]}], d) == b
    assert choose_confirmed([{"config": a, "costs": None, "error": err}], d) is None


def test_confirm_runs_at_the_end_and_is_what_compiling_applies(tmp_path, host, measurer):
    task = task_for(scale_add_func(), host, "scale_add", templates=[SplitVec()])
    log_path = tmp_path / "c.jsonl"
    Tuner([task], host, log_path, TuneOptions(trials=10, batch=5, seed=4, confirm_top=0), FAST,
          measurer=measurer).run()
    assert _confirms(log_path) == []
    # an unlucky measurement of the default (10x its time), so that the search's best is another config
    d = next(r for r in L.load(log_path, host).measures if r["config"] == task.default_config)
    _rewrite_costs(log_path, task.default_config, [c * 10 for c in d["costs"]])
    events = []
    res = Tuner([task], host, log_path, TuneOptions(trials=12, batch=2, seed=4, confirm_top=2, confirm_rounds=2),
                FAST, progress=events.append, measurer=measurer).run()
    assert res.trials_run == 2, "the search goes on, then confirms"
    tl = L.load(log_path, host)
    raw = sorted((r for r in tl.measures if L.median_cost(r) is not None), key=L.median_cost)
    confirms = _confirms(log_path)
    assert raw[0]["config"] != task.default_config
    assert [e["event"] for e in events][-1] == "confirm"
    assert len(confirms) == 1 and [e["event"] for e in events].count("confirm") == 1
    conf = confirms[0]
    top = [r["config"] for r in raw if r["config"] != task.default_config][:2]
    assert [c["config"] for c in conf["candidates"]] == top + [task.default_config]
    assert conf["rounds"] == 2 and all(len(c["costs"]) == 2 for c in conf["candidates"])
    assert conf["chosen"] in [c["config"] for c in conf["candidates"]]
    chosen = next(c for c in conf["candidates"] if c["config"] == conf["chosen"])
    dflt = conf["candidates"][-1]
    beats = [c for c in conf["candidates"][:-1] if all(x < y for x, y in zip(c["costs"], dflt["costs"]))]
    if beats:   # of those faster than the default in every round, the least median
        assert float(np.median(chosen["costs"])) == min(float(np.median(c["costs"])) for c in beats)
    else:       # none: the default stays
        assert chosen is dflt
    # the confirm's choice at its re-timed cost is what compiling applies and what the result reports
    best = L.best_configs(str(log_path), host)[task.workload_key]
    assert best["config"] == conf["chosen"] and best["cost"] == pytest.approx(float(np.median(chosen["costs"])))
    row = res.tasks[0]
    assert row["best_config"] == conf["chosen"] and row["best"] == pytest.approx(best["cost"])
    assert row["searched_best"] == pytest.approx(L.median_cost(raw[0]))
    assert row["confirm"]["chosen_is_default"] == (conf["chosen"] == task.default_config)
    # a rerun of the finished job re-times nothing: the confirm covers the search's best
    Tuner([task], host, log_path, TuneOptions(trials=12, confirm_top=2, confirm_rounds=2), FAST,
          measurer=measurer).run()
    assert len(_confirms(log_path)) == 1


def test_a_lucky_measurement_is_not_applied(tmp_path, host, measurer):
    """The slowest configuration gets a 1 ns record (one lucky measurement): without confirm it would be
    applied; the confirm rounds re-time it with the default and apply the faster of them, at real cost."""
    task = task_for(scale_add_func(), host, "scale_add", templates=[SplitVec()])
    log_path = tmp_path / "lucky.jsonl"
    Tuner([task], host, log_path, TuneOptions(trials=6, batch=5, seed=1, confirm_top=0), FAST,
          measurer=measurer).run()
    recs = L.load(log_path, host).measures
    slow = max((r for r in recs if r["config"] != task.default_config), key=L.median_cost)["config"]
    _rewrite_costs(log_path, slow, [1e-9, 1e-9, 1e-9])
    assert L.best_configs(str(log_path), host)[task.workload_key]["config"] == slow
    res = Tuner([task], host, log_path, TuneOptions(trials=6, confirm_top=1, confirm_rounds=3), FAST,
                measurer=measurer).run()
    assert res.trials_run == 0, "the job was finished: the confirm measures no new configuration"
    conf = _confirms(log_path)[-1]
    assert [c["config"] for c in conf["candidates"]] == [slow, task.default_config]
    best = L.best_configs(str(log_path), host)[task.workload_key]
    assert best["cost"] > 1e-7, "the lucky 1 ns is never applied"
    assert best["config"] == conf["chosen"]
    assert len(L.load(log_path, host).measures) == 6, "a confirm is not a measure record"


def test_a_crashing_or_wrong_candidate_is_never_chosen(tmp_path, host, measurer):
    """Records of a crashing and a wrong-result config, faked as the two fastest: the confirm rounds build
    and run them, record their errors, and keep the default."""
    task = task_for(scale_add_func(), host, "scale_add", templates=[Faulty()])
    log_path = tmp_path / "f.jsonl"
    Tuner([task], host, log_path, TuneOptions(trials=1, confirm_top=0), FAST, measurer=measurer).run()
    tl = L.load(log_path, host)
    d = tl.measures[0]
    with L.LogWriter(log_path) as w:
        for mode, cost in (("segv", 1e-9), ("wrong", 2e-9)):
            w.write(L.make_measure_record(target=host, workload_key=d["workload_key"], workload=d["workload"],
                                          template=d["template"], config={"mode": mode, "inner": 8},
                                          costs=[cost]))
    res = Tuner([task], host, log_path, TuneOptions(trials=3, confirm_top=2, confirm_rounds=2), FAST,
                measurer=measurer).run()
    conf = _confirms(log_path)[-1]
    kinds = {c["config"]["mode"]: (c["error"] or {}).get("kind") for c in conf["candidates"]}
    assert kinds == {"segv": "crash", "wrong": "wrong_result", "ok": None}, conf["candidates"]
    assert conf["chosen"] == task.default_config
    assert L.best_configs(str(log_path), host)[task.workload_key]["config"] == task.default_config
    assert res.tasks[0]["confirm"]["chosen_is_default"] is True


def test_a_later_better_search_result_applies_until_reconfirmed(tmp_path, host, measurer):
    task = task_for(scale_add_func(), host, "scale_add", templates=[SplitVec()])
    log_path = tmp_path / "later.jsonl"
    Tuner([task], host, log_path, TuneOptions(trials=6, batch=5, seed=2, confirm_top=0), FAST,
          measurer=measurer).run()
    recs = L.load(log_path, host).measures
    first = next(r["config"] for r in recs if r["config"] != task.default_config)
    _rewrite_costs(log_path, first, [1e-9])
    Tuner([task], host, log_path, TuneOptions(trials=6, confirm_top=1, confirm_rounds=1), FAST,
          measurer=measurer).run()
    assert len(_confirms(log_path)) == 1
    # a later job measures a new config whose record beats everything: the old confirm does not cover it
    new_cfg = next(c for c in task.space.all_configs() if c not in [r["config"] for r in recs])
    with L.LogWriter(log_path) as w:
        w.write(L.make_measure_record(target=host, workload_key=task.workload_key, workload=task.workload,
                                      template=task.family, config=new_cfg, costs=[1e-10]))
    tl = L.load(log_path, host)
    searched = min((r for r in tl.measures if L.median_cost(r) is not None), key=L.median_cost)
    assert searched["config"] == new_cfg and confirmed_choice(searched, tl.confirms[0]) is None
    assert L.best_configs(str(log_path), host)[task.workload_key]["config"] == new_cfg
    Tuner([task], host, log_path, TuneOptions(trials=7, confirm_top=1, confirm_rounds=1), FAST,
          measurer=measurer).run()
    confs = _confirms(log_path)
    assert len(confs) == 2 and [c["config"] for c in confs[1]["candidates"]] == [new_cfg, task.default_config]
    assert L.best_configs(str(log_path), host)[task.workload_key]["cost"] > 1e-7


def _confirm_line(host, chosen, candidates, **over):
    rec = {"type": "confirm", "v": 1, "target_key": L.target_key(host), "workload_key": "w", "template": "t",
           "candidates": candidates, "chosen": chosen, "rounds": 1}
    rec.update(over)
    return json.dumps(rec)


def test_malformed_confirm_lines_are_skipped_and_named(tmp_path, host):
    a, b = {"k": 1}, {"k": 2}
    meas = [L.make_measure_record(target=host, workload_key="w", workload={}, template="t", config=c, costs=[s])
            for c, s in ((a, 1e-3), (b, 2e-3))]
    ok = [{"config": a, "costs": [3e-3]}, {"config": b, "costs": [2.5e-3]}]
    lines = [json.dumps(m) for m in meas] + [
        _confirm_line(host, b, ok),                                              # 3: good
        _confirm_line(host, {"k": 9}, ok),                                       # 4: chosen not a candidate
        _confirm_line(host, a, [{"config": a, "costs": None, "error": {"kind": "crash", "message": ""}},
                                {"config": b, "costs": [1.0]}]),                 # 5: chosen has an error
        _confirm_line(host, a, [{"config": a, "costs": [1.0]}]),                 # 6: one candidate
        _confirm_line(host, a, None),                                            # 7: no candidates list
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n")
    tl = L.load(path, host)
    assert len(tl.confirms) == 1 and len(tl.measures) == 2
    assert [s.split(": skipped")[0] for s in tl.skipped] == [f"{path}:{i}" for i in (4, 5, 6, 7)]
    assert "chosen is not a candidate with costs" in tl.skipped[0]
    best = tl.best()["w"]
    assert best["config"] == b and best["confirmed"] and L.median_cost(best) == pytest.approx(2.5e-3)
    rows = L.summary([path], host)
    assert rows[0]["best_config"] == b and rows[0]["confirmed"] is True
    # pruning keeps the search's best, the confirm, and the chosen config's record: the same choice applies
    out = tmp_path / "best.jsonl"
    n = L.merge([path], out, best_only=True)
    assert n["confirms"] == 1 and n["records"] == 3
    assert L.load(out, host).best()["w"]["config"] == b
    with pytest.raises(ValueError, match="chosen is not a candidate"):
        L.make_confirm_record(target=host, workload_key="w", workload={}, template="t", candidates=ok,
                              chosen={"k": 9}, rounds=1)


def test_cli_rejects_bad_confirm_options(tmp_path, capsys):
    import onnx

    from tvmfuse import models as M
    from tvmfuse.cli import main

    model = tmp_path / "chain.onnx"
    onnx.save(M.matmul_bias_act(8, 16, 16, act="Relu"), model)
    rc = main(["tune", str(model), "--trials", "1", "--log", str(tmp_path / "t.jsonl"), "--confirm-top", "-1"])
    err = capsys.readouterr().err
    assert rc == 2 and "--confirm-top must be 0 or more" in err and "Traceback" not in err, err
    assert not (tmp_path / "t.jsonl").exists()
