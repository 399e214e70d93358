"""The demo's typed stage results: kept in ``stage.json`` in the JSON form the dict results had,
and read back from the cache as the same records."""

from __future__ import annotations

import json
import math
import os

from cooper_mcore.demo.pipeline import STAGE_FILE, run_stage
from cooper_mcore.demo.results import (
    BenchAccuracy,
    CurvePoint,
    Figures,
    PolicyAccuracy,
    RLResult,
    RMDataResult,
    RMOnSamples,
    Separation,
    from_plain,
    to_plain,
)

FIG = Figures(acc=0.5, rule_acc=0.25, rule_recall=0.5, rule_precision=1.0, n=4, forms={"boxed": 1.0})
ACC = PolicyAccuracy(acc=0.5, rule_acc=0.25, families={"all": FIG, "times": FIG}, acc_greedy=0.75, n_prompts=2, k=2,
                     temperature=0.7, seed=3, problem_acc=[0.5, 0.5], kinds={"right": 0.5})


def test_a_typed_stage_result_is_stored_flat_and_read_back_typed(tmp_path):
    result = RLResult(eval=ACC, rl_seconds=1.5, curve=[CurvePoint(step=1, families={"all": FIG})], rm_acc_own=0.5,
                      bench=BenchAccuracy(acc=0.5, pair_acc=1.0, families={"times": 0.5}))
    first = run_stage(str(tmp_path), "rl_cooper", {}, [], lambda d: result, RLResult)
    again = run_stage(str(tmp_path), "rl_cooper", {}, [], lambda d: None, RLResult)  # cached: fn not called
    assert again.info == first.info and isinstance(again.info, RLResult) and first.info.seconds >= 0.0
    with open(os.path.join(first.path, STAGE_FILE)) as f:
        info = json.load(f)["info"]
    assert list(info) == ["eval", "rl_seconds", "curve", "rm_acc_own", "bench", "seconds"]
    assert info["curve"] == [{"step": 1, "all": to_plain(FIG)}]
    assert info["eval"]["families"]["times"]["forms"] == {"boxed": 1.0}


def test_results_measured_only_sometimes_are_left_out_and_nan_survives():
    rule = to_plain(RLResult(eval=ACC, rl_seconds=1.0, curve=[]))
    assert "bench" not in rule and "rm_acc_own" not in rule
    data = to_plain(RMDataResult(bench_pairs=0, labels="simulated judge", train=3))
    assert list(data) == ["bench_pairs", "labels", "train", "train_correct", "blind_spot_rows", "rows_after_swap",
                          "val", "seconds"]
    own = RMOnSamples(acc_all=0.5, families={"all": Separation(acc=0.5, separation=0.0)})
    assert to_plain(own) == {"acc_all": 0.5, "all": {"acc": 0.5, "separation": 0.0}}
    assert from_plain(RMOnSamples, json.loads(json.dumps(to_plain(own)))) == own
    empty = from_plain(BenchAccuracy, json.loads(json.dumps(to_plain(BenchAccuracy(float("nan"), float("nan"), {})))))
    assert math.isnan(empty.acc) and empty.families == {}


def test_the_rm_gate_and_the_separations_are_read_back_typed(tmp_path):
    from cooper_mcore.algo.stats import Estimate
    from cooper_mcore.demo.results import OwnAnswers, RMGate, RMResult

    own = RMOnSamples(acc_all=0.5, families={"all": Separation(acc=0.5, separation=0.0)})
    result = RMResult(checkpoint="train/final", bench=BenchAccuracy(0.9, 0.95, {"times": 0.9}, right=[True, False]),
                      own=own, train_acc=0.8, steps=10,
                      gate=RMGate(accuracy={"plus_minus": 0.95, "times": 0.91}, threshold=0.93, epochs=14,
                                  best_epoch=12, met=False),
                      own_answers=Estimate(0.8, 0.02))
    again = run_stage(str(tmp_path), "rm", {}, [], lambda d: result, RMResult)
    cached = run_stage(str(tmp_path), "rm", {}, [], lambda d: None, RMResult)
    assert cached.info == again.info
    assert isinstance(cached.info.gate, RMGate) and isinstance(cached.info.own_answers, Estimate)
    assert cached.info.bench.right == [True, False]
    old = to_plain(result)
    del old["gate"], old["own_answers"]  # a cache written before the gate: both read back as None
    assert from_plain(RMResult, old).gate is None and from_plain(RMResult, old).own_answers is None
    pair = OwnAnswers(Estimate(0.6, 0.04), Estimate(0.7, 0.03))
    assert from_plain(OwnAnswers, json.loads(json.dumps(to_plain(pair)))) == pair
