"""`draftsmith report` on a tiny random target: the files, the consistency of report.json's figures,
the exact fp32 replay of the decoder's rounds, and bad input as one-line errors.

Three drafters side by side: prompt lookup (the recipe's, model-free), a saved draft LM (3 of the
target's 4 layers: high agreement, an HF cache that rolls back) and a saved EAGLE-3 head (target
features, untrained). The run takes ≈ 25 s on one thread.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from draftsmith.cli import main
from draftsmith.measure.prompts import Question
from draftsmith.report.alignment import expected_rounds
from draftsmith.report.run import drafter_entries, reference_answers
from draftsmith.report.summary import calibration, compare, null_round_se, ratio_se, tau_of

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a poem about the sea.", "Now make it shorter."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 times 13?"]},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target_dir):
    from draftsmith.drafters import save
    from draftsmith.drafters.draft_lm import DraftLMConfig
    from draftsmith.drafters.eagle3 import Eagle3Config
    from draftsmith.target import load_target

    root = tmp_path_factory.mktemp("report")
    target = load_target(tiny_target_dir, dtype="float32")
    draft_lm = DraftLMConfig(num_layers=3)
    save(str(root / "draftlm"), draft_lm, draft_lm.build_module(target), target)
    (root / "train_summary.json").write_text(json.dumps({  # as draftsmith train writes it beside drafter/
        "steps": 20, "sim_tau_curve": [{"step": 0, "sim_tau": 1.2}, {"step": 10, "sim_tau": 2.5}, {"step": 20, "sim_tau": 2.4}],
        "best": {"step": 10, "sim_tau": 2.5, "k": K, "greedy": True}}))
    eagle3 = Eagle3Config(feature_layers=[0, 1, 2])
    save(str(root / "eagle3"), eagle3, eagle3.build_module(target), target)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return root, prompts


@pytest.fixture(scope="module")
def report(setup, tiny_target_dir):
    root, prompts = setup
    code = main(["report", "-c", "smollm2-135m-eagle3", f"target.name={tiny_target_dir}", "drafter.type=prompt_lookup",
                 f"eval.prompts={prompts}", "eval.num_prompts=2", f"decode.k={K}", "decode.max_new_tokens=10",
                 f"run_dir={root / 'run'}",
                 "--compare", str(root / "draftlm"), str(root / "eagle3"), "report.seeds=[0]"])  # overrides may follow
    assert code == 0
    out = root / "run" / "report"
    return json.loads((out / "report.json").read_text()), out


def test_writes_json_markdown_and_readable_plots(report):
    data, out = report
    assert list(data["drafters"]) == ["prompt_lookup", "draftlm", "eagle3"]
    for name in ("acceptance_by_position", "accepted_length_histogram", "calibration", "per_category",
                 "predicted_vs_measured"):
        png = (out / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    md = (out / "report.md").read_text()
    for section in ("## Summary", "## Tolerance", "## Acceptance by draft position", "## By category", "## Calibration",
                    "## Where the drafters fail", "## Lossless audit"):
        assert section in md
    assert "| τ greedy, decoder | " in md and "prompt_lookup | draftlm | eagle3" in md
    assert "bonus/resampled token counted" in md
    assert (out / "training_sim_tau.png").read_bytes()[:4] == b"\x89PNG" and "## Over training" in md
    assert "10 (2.500)" in md  # drafter-best's step and sim_tau
    assert data["drafters"]["draftlm"]["training"]["best"]["step"] == 10  # read from the run beside each folder
    assert data["prompts"] == {"source": data["prompts"]["source"], "questions": 2, "asked": 3, "second_turns": 1}


def test_histograms_rounds_and_categories_add_up(report):
    data, _ = report
    assert data["decode"]["seeds"] == [0]
    for name, res in data["drafters"].items():
        for mode in ("greedy", "greedy_fp32", "sampled"):
            d = res["decoding"][mode]
            assert sum(d["accepted_length_histogram"]) == d["verify_rounds"], (name, mode)
            assert len(d["accepted_length_histogram"]) == K + 1
            assert sum(c["verify_rounds"] for c in d["by_category"].values()) == d["verify_rounds"]
            assert sum(c["prompts"] for c in d["by_turn"].values()) == 3
            assert set(d["by_category"]) == {"writing", "math"} and set(d["by_turn"]) == {"turn 1", "turn 2"}
            emitted = d["verify_rounds"] - d["eos_rounds"] + sum(n * c for n, c in enumerate(d["accepted_length_histogram"]))
            tau = emitted / d["verify_rounds"]
            assert d["tau_with_bonus"] == pytest.approx(tau, abs=1e-4)
        assert res["decoding"]["greedy"]["speed"]["speedup_vs_target"] > 0


def test_alignment_figures_are_consistent(report):
    data, _ = report
    for name, res in data["drafters"].items():
        al = res["alignment"]
        tf, ro, pred = al["teacher_forced"], al["rollout"], al["prediction"]
        # τ of full rounds = 1 + Σ_j cumulative α_j (measure/costs' formula)
        assert pred["tau_steady_greedy"] == pytest.approx(1 + sum(tf["cumulative_top1"]), abs=1e-3)
        assert pred["tau_steady_sampled"] == pytest.approx(1 + sum(ro["cumulative_alpha"]), abs=1e-3)
        # greedy verifies draft j only after 1..j-1 matched: forced and rollout contexts coincide
        assert tf["cumulative_top1"] == ro["cumulative_top1"], name
        assert tf["alpha"][0] == pytest.approx(ro["alpha"][0], abs=1e-6)  # position 1: the same context
        for cum in (tf["cumulative_top1"], tf["cumulative_alpha"], ro["cumulative_alpha"]):
            assert all(a >= b - 1e-9 for a, b in zip(cum, cum[1:])), cum
        assert all(0 <= x <= 1 for x in tf["alpha"] + ro["alpha"] + tf["top1"])
        # calibration bins cover every draft; ECE recomputed from the bins
        cal = al["calibration"]
        assert sum(b["count"] for b in cal["bins"]) == cal["drafts"] > 0
        assert len(cal["bins"]) == 10 and cal["bins"][0]["lo"] == 0.0 and cal["bins"][-1]["hi"] == 1.0
        ece = sum(b["count"] / cal["drafts"] * abs(b["accuracy"] - b["confidence"]) for b in cal["bins"] if b["count"])
        assert cal["ece"] == pytest.approx(ece, abs=1e-3)
        assert sum(pred["greedy"]["accepted_length_histogram"]) == pytest.approx(pred["greedy"]["rounds"], abs=1e-6)
    for name in ("draftlm", "eagle3"):  # model drafters always propose the whole chain k_m = min(k, 10 - m - 1, N - m)
        assert data["drafters"][name]["alignment"]["answer_tokens"] == 30
        assert data["drafters"][name]["alignment"]["proposed_at_position"] == [24, 21, 18]  # 3 answers of 10 tokens
        al = data["drafters"][name]["alignment"]
        assert al["calibration"]["drafts"] == sum(al["proposed_at_position"])
    assert data["drafters"]["eagle3"]["alignment"]["teacher_forced"]["forward_kl"][0] > 0


def test_fp32_greedy_is_predicted_exactly_and_lossless(report):
    """In fp32 the greedy decoder's rounds are the replay of the offline per-start accepted lengths."""
    data, _ = report
    for name, res in data["drafters"].items():
        pvm = res["prediction_vs_measurement"]
        rep = pvm["greedy_fp32_replay"]
        assert rep["exact"] and [round(x) for x in rep["predicted_histogram"]] == rep["decoder_histogram"], name
        assert pvm["greedy_fp32"]["difference"] == pytest.approx(0.0, abs=1e-3) and pvm["greedy_fp32"]["within"]
        assert res["audit"] == {**res["audit"], "prompts": 3, "identical": 3, "divergences": []}
    taus = {n: r["decoding"]["greedy_fp32"]["tau_with_bonus"] for n, r in data["drafters"].items()}
    assert taus["draftlm"] > taus["eagle3"]  # 3 of the target's 4 layers agree more than a random head


def test_per_category_takes_the_first_questions_of_each_category():
    from draftsmith.report.run import select_questions

    qs = select_questions("mtbench", 10, 2)
    cats = [q.category for q in qs]
    assert len(qs) == 16 and len(set(cats)) == 8 and all(cats.count(c) == 2 for c in cats)
    assert [q.id for q in select_questions("mtbench", 3, 0)] == ["81", "82", "83"]


def test_second_turn_follows_the_targets_own_first_answer(tiny_target):
    asked, turns, answers = reference_answers(tiny_target, [Question("7", "x", ["first", "second"])], 6, 2)
    assert [q.id for q in asked] == ["7", "7.2"] and turns == [1, 2]
    assert asked[1].history == [{"role": "user", "content": "first"},
                                {"role": "assistant", "content": tiny_target.tokenizer.decode(answers[0], skip_special_tokens=True)}]
    assert asked[1].messages()[-1] == {"role": "user", "content": "second"}
    assert len(answers[1]) == 6


# ------------------------------------------------------------------ the pure parts


def test_calibration_bins_and_ece():
    cal = calibration(np.array([0.05, 0.15, 0.95, 0.95, 1.0]), np.array([0.0, 1.0, 1.0, 0.0, 1.0]), 10)
    assert [b["count"] for b in cal["bins"]] == [1, 1, 0, 0, 0, 0, 0, 0, 0, 3]
    assert cal["bins"][9]["accuracy"] == pytest.approx(2 / 3, abs=1e-4)
    assert cal["ece"] == pytest.approx((0.05 + 0.85 + 3 * abs(2 / 3 - (0.95 + 0.95 + 1.0) / 3)) / 5, abs=1e-4)


def test_expected_rounds_by_hand():
    # 3-token answer ending in EOS, k = 1: at m = 1 and m = 2 a draft is accepted with probability 1/2
    rounds, tokens, hist = expected_rounds(np.array([[0.5], [0.5]]), np.array([1, 1]), 3, 1)
    assert (rounds, tokens) == pytest.approx((1.5, 2.25))
    assert hist.tolist() == pytest.approx([0.75, 0.75])
    # the round that accepts the final EOS emits no bonus token: reached at m = 2 with probability 1/2 (m = 1
    # rejected), then accepted with 1/2
    assert expected_rounds(np.array([[0.5], [0.5]]), np.array([1, 1]), 3, 1, ends_with_eos=True)[1] == pytest.approx(
        2.25 - 0.5 * 0.5)
    # greedy survivals are a replay: all accepted (k = 2, 10 tokens capped by max_new = 10: k_m = min(2, 9 - m))
    k_m = np.array([min(2, 10 - m - 1, 10 - m) for m in range(1, 10)])
    surv = np.array([[1.0, 1.0 if k > 1 else np.nan] for k in k_m])
    rounds, tokens, hist = expected_rounds(surv, k_m, 10, 2)
    assert hist.tolist() == [0, 0, 3] and rounds == 3 and tokens == 9  # m = 1, 4, 7 accept 2, then the end


def test_standard_errors_and_the_tolerance():
    assert ratio_se([2, 2, 2], [1, 1, 1]) == 0.0
    assert ratio_se([1, 3], [1, 1]) == pytest.approx(math.sqrt(2 * (1 + 1)) / 2)
    assert null_round_se([1, 1], 4) == pytest.approx(0.5 / 2)
    assert tau_of([0.5, 0.25]) == pytest.approx(1.75)
    pred = {"tau": 1.5, "accepted_length_histogram": [1.0, 1.0]}
    flat = {"tau_with_bonus": 1.0, "tau_se": 0.0, "verify_rounds": 100}  # no spread measured: the null's SE is used
    c = compare(pred, flat, 3.0)
    assert c["se"] == pytest.approx(0.05) and c["tolerance"] == pytest.approx(0.15) and not c["within"]
    assert compare(pred, {**flat, "tau_with_bonus": 1.4}, 3.0)["within"]


# ------------------------------------------------------------------ bad input


def _error(capsys, args: list[str]) -> str:
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    lines = [x for x in err.splitlines() if x.startswith("draftsmith: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_bad_input_is_one_line(capsys, setup, tiny_target_dir, tmp_path):
    root, prompts = setup
    base = ["report", "-c", "smollm2-135m-eagle3", f"target.name={tiny_target_dir}", f"run_dir={tmp_path}",
            f"eval.prompts={prompts}"]
    assert "does not exist" in _error(capsys, base + ["--compare", str(tmp_path / "nope")])
    (tmp_path / "empty_dir").mkdir()
    assert "is not a drafter folder" in _error(capsys, base + ["--compare", str(tmp_path / "empty_dir")])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "holds no prompts" in _error(capsys, base[:-1] + [f"eval.prompts={empty}"])
    assert "decode.tree=none" in _error(capsys, base + ["decode.tree=dynamic"])
    assert "report.temperature" in _error(capsys, base + ["report.temperature=0"])
    assert "report.turns" in _error(capsys, base + ["report.turns=3"])
    assert "decode.min_confidence=0" in _error(capsys, base + ["decode.min_confidence=0.5"])


def test_rollout_p_equals_a_fresh_forward_over_the_drafted_prefix(tiny_target):
    """The batched masked forward over the answer's cache gives the target's p after prompt + y_<m + d_<j."""
    import torch

    from draftsmith.report.alignment import rollout_ps

    seq = list(range(100, 120))  # prompt (8) + answer (12)
    P = 8
    cache = tiny_target.new_cache()
    full = tiny_target.forward(torch.tensor([seq]), cache)
    p_t = torch.softmax(full.logits[0, P - 1 : len(seq) - 1].float() / 0.7, -1)  # p of the answer tokens
    chains = []
    for m, drafts in ((5, lambda t: [t[0], 777, 778, 779]), (2, lambda t: [555, 556, 557]), (7, lambda t: t[:3]),
                      (9, lambda t: [t[0], t[1], 900])):
        truth = seq[P + m : P + m + 4]
        chains.append((P + m, drafts(truth), truth, m))
    got = rollout_ps(tiny_target, cache, seq, chains, p_t, 0.7)
    assert cache.get_seq_length() == len(seq)  # cropped back
    for (start, drafts, _, _), p in zip(chains, got):
        assert p.shape[0] == len(drafts)
        for j in range(len(drafts)):
            ids = seq[:start] + drafts[:j]
            want = torch.softmax(tiny_target.forward(torch.tensor([ids])).logits[0, -1].float() / 0.7, -1)
            assert torch.allclose(p[j], want, atol=1e-5), (start, j)


def test_a_drafter_without_offline_alignment_still_renders(report, tmp_path):
    """A self-speculative drafter is decoded but not aligned offline: every table and plot copes."""
    import copy

    from draftsmith.report.render import write_report

    data = copy.deepcopy(report[0])
    data["drafters"]["eagle3"]["alignment"] = {"skipped": "a self-speculative drafter drafts inside the target's cache"}
    data["drafters"]["eagle3"]["prediction_vs_measurement"] = {"skipped": "no alignment"}
    write_report(data, str(tmp_path))
    md = (tmp_path / "report.md").read_text()
    assert "**eagle3**: offline alignment skipped: a self-speculative drafter" in md
    assert (tmp_path / "calibration.png").stat().st_size > 10_000


def test_the_report_adds_the_model_free_baselines_beside_the_drafters(setup):
    from draftsmith.drafters.eagle3 import Eagle3Config
    from draftsmith.drafters.prompt_lookup import PromptLookupConfig

    root, _ = setup
    entries = drafter_entries(Eagle3Config(), [str(root / "draftlm")], ["prompt_lookup", "suffix"])
    assert [(name, cfg.type) for name, cfg in entries] == [
        ("eagle3", "eagle3"), ("draftlm", "saved"), ("prompt_lookup", "prompt_lookup"), ("suffix", "suffix")]
    entries = drafter_entries(PromptLookupConfig(), [], ["prompt_lookup"])  # the recipe's drafter is the baseline
    assert [name for name, _ in entries] == ["prompt_lookup"]
