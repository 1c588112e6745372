"""The cost model: τ(k) follows from the acceptance by position, the drafter's time is counted apart from the
target's, and evaluation measures the target alone (the ceiling's oracle: tests/test_benchmarks.py)."""

from __future__ import annotations

import statistics

import pytest
import torch

from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.stats import conditional_acceptance, tau_from_acceptance
from draftsmith.drafters.layer_skip import layer_skip_drafter
from draftsmith.drafters.registry import model_free_config
from draftsmith.measure.config import DecodeConfig
from draftsmith.measure.costs import TimedDrafter, median_interval, predicted_speedup, verify_costs
from draftsmith.measure.evaluate import evaluate
from draftsmith.measure.paired import paired_runs
from draftsmith.measure.prompts import Question
from draftsmith.decode.reference import target_greedy

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tau_from_conditional_acceptance_is_exact():
    assert tau_from_acceptance([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert tau_from_acceptance([0.5, 0.5, 0.5], 1) == pytest.approx(1.5)
    assert tau_from_acceptance([], 4) == 1.0
    assert predicted_speedup([1.0, 1.0], 2, v=1.5, c=0.25) == pytest.approx(3 / 2.0)


def test_the_median_interval_brackets_the_median_and_narrows_with_prompts():
    assert median_interval([1.1] * 5) == pytest.approx((1.1, 1.1))
    few = [0.8, 0.9, 1.0, 1.1, 1.2, 1.05, 0.95, 1.0]
    lo, hi = median_interval(few)
    assert lo <= statistics.median(few) <= hi and (lo, hi) == median_interval(few)  # fixed seed: reproducible
    lo4, hi4 = median_interval(few * 4)  # the same spread over 4x the prompts
    assert lo <= lo4 <= hi4 <= hi and hi4 - lo4 < (hi - lo) * 0.75
    with pytest.raises(ValueError):
        median_interval([])


def test_conditional_acceptance_undoes_the_cumulative_share():
    # cumulative: drafts 1..i all accepted in 60%, 30%, 15% of rounds → each given the previous: 0.6, 0.5, 0.5
    assert conditional_acceptance([0.6, 0.3, 0.15, None]) == pytest.approx([0.6, 0.5, 0.5])
    assert conditional_acceptance([0.0, 0.0]) == [0.0, 0.0]


def test_timed_drafter_counts_drafting_only_and_keeps_the_self_speculative_hooks(tiny_target):
    inner = layer_skip_drafter(tiny_target.model, 1, share_cache=True)
    timed = TimedDrafter(inner)
    assert timed.verify == inner.verify and timed.bind == inner.bind
    prompt = [1, 2, 3, 4, 5]
    res = speculative_decode(tiny_target, timed, prompt, k=3, max_new_tokens=16)
    assert res.tokens == target_greedy(tiny_target, prompt, 16)
    assert timed.drafted == res.stats.drafted and 0 < timed.seconds < res.stats.wall_s


def test_verify_costs_are_relative_to_a_one_token_step(tiny_target):
    v = verify_costs(tiny_target, [1, 2, 3], [1, 4], context=32, repeats=3)
    assert set(v) == {1, 4} and all(x > 0 for x in v.values())


def test_eval_times_the_target_alone_and_reports_the_median_ratio(tiny_target):
    tok = tiny_target.tokenizer
    questions = [Question(str(i), "x", [text]) for i, text in enumerate(["hello there", "a b c d", "tell me"])]
    drafter = layer_skip_drafter(tiny_target.model, 1, share_cache=True)
    out = evaluate(tiny_target, drafter, questions, DecodeConfig(k=2, max_new_tokens=10), check_identity=True,
                   progress=False, time_target=True)
    assert tok is not None and len(out.records) == 3
    ratios = []
    for rec in out.records:
        assert rec["identical_to_target"] is True
        # tokens/s as recorded (3 decimals; wall_s has 4, too coarse for a tiny model's millisecond decodes)
        spec, alone = rec["stats"]["tokens_per_s"], rec["target"]["tokens_per_s"]
        assert spec == pytest.approx(rec["stats"]["new_tokens"] / rec["stats"]["wall_s"], rel=2e-2)
        assert rec["speedup_vs_target"] == pytest.approx(spec / alone, rel=2e-3)
        ratios.append(rec["speedup_vs_target"])
    s = out.speed
    assert s["speedup_vs_target"] == pytest.approx(statistics.median(ratios), rel=1e-3)
    lo, hi = s["speedup_interval_90"]
    assert min(ratios) - 1e-3 <= lo <= s["speedup_vs_target"] <= hi <= max(ratios) + 1e-3
    assert s["dtype"] == "float32" and s["threads"] == torch.get_num_threads()
    cm = s["cost_model"]
    assert cm["draft_cost_c"] > 0 and set(cm["verify_cost_by_k"]) == {1, 2}
    assert cm["best_k"] in cm["predicted_speedup_by_k"]
    # the model over the rounds as decoded: tau over the mean of v(n verified) (v(0) = 1) plus drafting per round
    rounds, sizes = out.stats.rounds, out.stats.tree_sizes
    verify = sum(m * (cm["verify_cost_by_k"][n] if n else 1.0) for n, m in sizes.items()) / rounds
    assert sum(sizes.values()) == rounds and cm["as_decoded_speedup"] > 0
    assert out.stats.tau / cm["as_decoded_speedup"] - verify > 0  # what is left is the drafting cost per round


def test_eval_without_timing_has_no_speed(tiny_target):
    questions = [Question("0", "x", ["hello"])]
    drafter = layer_skip_drafter(tiny_target.model, 1, share_cache=True)
    out = evaluate(tiny_target, drafter, questions, DecodeConfig(k=2, max_new_tokens=6), progress=False)
    assert out.speed is None and "target" not in out.records[0]


def test_paired_runs_rotate_the_order_and_keep_each_methods_fastest_run():
    calls = []
    seconds = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 6.0, 4.0])}

    def method(name):
        def run(prompt):
            calls.append(name)
            return f"{name}-out", next(seconds[name])
        return run

    out = paired_runs({"a": method("a"), "b": method("b")}, [1, 2], repeats=3, start=1)
    assert calls == ["b", "a", "a", "b", "b", "a"]  # run r starts at (start + r) % 2: B A, A B, B A
    assert out["a"] == (("a-out", 1.0), [3.0, 1.0, 2.0]) and out["b"] == (("b-out", 4.0), [5.0, 6.0, 4.0])


def test_eval_repeats_pair_the_baselines_with_the_target_on_each_prompt(tiny_target):
    questions = [Question(str(i), "x", [text]) for i, text in enumerate(["hello there", "a b c d"])]
    drafter = layer_skip_drafter(tiny_target.model, 1, share_cache=True)
    lookup = model_free_config("prompt_lookup").build(tiny_target)
    out = evaluate(tiny_target, drafter, questions, DecodeConfig(k=2, max_new_tokens=8), progress=False,
                   time_target=True, repeats=2, baselines={"prompt_lookup": lookup})
    assert out.speed["timing_repeats"] == 2
    side = out.baselines["prompt_lookup"]
    assert len(side.records) == 2 and side.stats.sequences == 2 and out.stats.sequences == 2  # one decode counted
    for rec, brec in zip(out.records, side.records):
        runs = rec["wall_s_runs"]
        assert set(runs) == {"drafter", "prompt_lookup", "target"} and all(len(r) == 2 for r in runs.values())
        assert rec["target"]["wall_s"] == pytest.approx(min(runs["target"]), abs=1e-4)  # the fastest run counts
        assert rec["stats"]["wall_s"] == pytest.approx(min(runs["drafter"]), abs=1e-4)
        assert brec["stats"]["wall_s"] == pytest.approx(min(runs["prompt_lookup"]), abs=1e-4)
        assert brec["speedup_vs_target"] == pytest.approx(brec["stats"]["tokens_per_s"] / rec["target"]["tokens_per_s"],
                                                          rel=2e-3)
        assert brec["tokens"] == rec["tokens"]  # fp32 greedy: the same output as the target's
    with pytest.raises(Exception, match="repeats"):
        evaluate(tiny_target, drafter, questions, DecodeConfig(k=2, max_new_tokens=8), progress=False, repeats=0)
