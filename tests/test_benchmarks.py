"""The benchmark harnesses of ``benchmarks/`` that measure the decoder itself, loaded from their files (they are
scripts, not part of the package): the ceiling's oracle drafter (``ceiling.py``) and the decode comparison against HF
assisted generation (``decode.py``)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.reference import target_greedy

from .conftest import benchmark_script

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ceiling():
    yield benchmark_script("ceiling")
    del sys.modules["draftsmith_bench_ceiling"]


@pytest.fixture(scope="module")
def decode():
    yield benchmark_script("decode")
    del sys.modules["draftsmith_bench_decode"]


# ---------------------------------------------------------------- benchmarks/ceiling.py


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_oracle_is_always_accepted_in_fp32(ceiling, tiny_target, k):
    prompt = [1, 2, 3, 4, 5]
    ref = ceiling.oracle_reference(tiny_target, prompt, k, max_new_tokens=31)
    res = speculative_decode(tiny_target, ceiling.OracleDrafter(ref), prompt, k=k, max_new_tokens=31)
    assert res.tokens == target_greedy(tiny_target, prompt, 31) == ref[len(prompt):]
    # every round accepts all k drafts: τ = k + 1 exactly (the last round may be cut by max_new_tokens)
    full = [n for n in range(k + 1) if res.stats.accept_hist[n]]
    assert res.stats.accept_hist[k] >= res.stats.rounds - 1 and len(full) <= 2
    assert res.stats.accepted == res.stats.drafted


def test_a_wrong_oracle_is_rejected_and_then_drafts_nothing(ceiling, tiny_target):
    prompt = [1, 2, 3, 4, 5]
    ref = ceiling.oracle_reference(tiny_target, prompt, 2, max_new_tokens=12)
    # new token 0 comes from the prefill; round 1 proposes new tokens 1 and 2, and 2 is wrong
    wrong = ref[: len(prompt) + 2] + [(t + 1) % 100 for t in ref[len(prompt) + 2:]]
    res = speculative_decode(tiny_target, ceiling.OracleDrafter(wrong), prompt, k=2, max_new_tokens=12)
    assert res.tokens == ref[len(prompt):]  # lossless anyway
    assert (res.stats.drafted, res.stats.accepted) == (2, 1)  # off the reference after the rejection: no drafts


def test_ceiling_reports_the_oracle_end_to_end_and_with_the_prefill_taken_out(ceiling, tiny_target):
    prompts = [list(range(10, 40)), list(range(50, 90)), list(range(100, 125))]
    res = ceiling.bench_ceiling(tiny_target, prompts, [1, 3], max_new_tokens=12)
    assert res["prompts"] == 2 and [r["k"] for r in res["table"]] == [1, 3]
    for r in res["table"]:
        assert r["oracle_tau"] == pytest.approx(r["k"] + 1, abs=0.5)  # fp32: the oracle is always accepted
        assert r["prefill_s"] > 0 and r["decode_phase_speedup"] > 0
        assert r["decode_phase_share_of_bound"] == pytest.approx(r["decode_phase_speedup"] / r["bound"], rel=2e-2)
        # the prefill is paid on both sides, so the end-to-end bound lies between 1 and the decode bound (a tiny
        # model's verify cost is timed: under load the bound itself can fall below 1, the order then reverses)
        low, high = sorted((1.0, r["bound"]))
        assert low - 1e-3 <= r["end_to_end_bound"] <= high + 1e-3 and r["share_of_end_to_end_bound"] > 0


# ---------------------------------------------------------------- benchmarks/decode.py


@pytest.mark.parametrize("argv,fragment", [(["--k", "0"], "--k"), (["--sweep-layers", "8,x"], "--sweep-layers")])
def test_bad_arguments_exit_2_naming_the_option(decode, capsys, argv, fragment):
    with pytest.raises(SystemExit) as e:
        decode.main(argv)
    assert e.value.code == 2 and fragment in capsys.readouterr().err


@pytest.mark.e2e
def test_decode_runs_all_three_and_checks_identity(decode, capsys, tmp_path, smollm2_folder):
    out_json = tmp_path / "decode.json"
    code = decode.main(["--dtypes", "float32", "--prompts", "1", "--max-new-tokens", "6", "--layers", "24", "--k", "2",
                        "--threads", "1", "--out", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "draftsmith / hf_assisted" in out
    res = json.loads(out_json.read_text())["results"]["float32"]
    s = res["summary"]
    assert s["draftsmith"]["identical_to_greedy"] == 1 and s["hf_assisted"]["identical_to_greedy"] == 1
    # both speculative methods did the same number of verification rounds: same drafter, same k
    assert s["draftsmith"]["target_forwards"] == s["hf_assisted"]["target_forwards"]
    assert s["greedy"]["new_tokens"] == s["draftsmith"]["new_tokens"]


# ---------------------------------------------------------------- benchmarks/levers.py


def test_every_lever_is_a_valid_override_of_the_eagle3_recipe():
    from draftsmith.config import load_recipe

    levers = benchmark_script("levers")
    try:
        for name, flags in levers.VARIANTS.items():
            recipe = load_recipe("smollm2-135m-eagle3", flags)
            assert name == "base" or flags, name
            if "train.loss.kind=lk_alpha" in flags:
                assert recipe.train.loss.kind == "lk_alpha"
            assert recipe.train.coral_weight == (0.1 if name.endswith("+coral") else 0.0), name
    finally:
        del sys.modules["draftsmith_bench_levers"]


def test_levers_decodes_a_drafter_folder_inside_a_run_and_tables_the_raw_weights_of_an_ema_run(tmp_path):
    """``decode RUN/drafter-raw`` decodes that folder with its run's recipe, into a file of its own; the table shows a
    run's raw weights beside its moving average (held-out at the end and best, decoded) and – for other runs."""
    levers = benchmark_script("levers")
    try:
        run = tmp_path / "run"
        (run / "drafter-raw").mkdir(parents=True)
        (run / "config.yaml").write_text("{}")
        (run / "drafter-raw" / "config.json").write_text("{}")
        assert levers.decode_source(str(run)) == (str(run), str(run / "drafter-best"), "drafter-best")
        assert levers.decode_source(str(run / "drafter-raw") + "/") == (str(run), str(run / "drafter-raw"), "drafter-raw")
        with pytest.raises(SystemExit, match="neither a run folder"):
            levers.decode_source(str(tmp_path))
        assert [levers.decode_file(d, q, n) for d, q, n in [
            ("drafter-best", "mtbench", 20), ("drafter-raw", "mtbench", 20), ("drafter-best", "copyheavy", 20),
            ("drafter-raw", "some/H.jsonl", 80)]] == [
            "levers_decode.json", "levers_decode.drafter-raw.json", "levers_decode-copyheavy.json",
            "levers_decode-H80.drafter-raw.json"]

        held = {"heldout/top1_step0": 0.5, "heldout/expected_accept_step0": 0.4, "heldout/loss": 6.0, "sim_tau": 1.7}
        curve = [{"step": 0, "sim_tau": 1.1, "raw_sim_tau": 1.1}, {"step": 300, "sim_tau": 1.6, "raw_sim_tau": 1.68},
                 {"step": 600, "sim_tau": 1.7, "raw_sim_tau": 1.65}]
        summary = {"heldout": {**held, "raw/sim_tau": 1.65}, "best": {"step": 600, "sim_tau": 1.7}, "steps": 600,
                   "sim_tau_curve": curve}
        (run / "train_summary.json").write_text(json.dumps(summary))
        (run / "logs").mkdir()
        (run / "logs" / "train.rank0.jsonl").write_text(json.dumps({"step": 10, "loss": 9.0}) + "\n")
        by_k = lambda *taus: json.dumps({"by_k": {str(k): {"tau_with_bonus": t} for k, t in zip((3, 4), taus)}})
        (run / "levers_decode.json").write_text(by_k(1.55, 1.6))
        (run / "levers_decode.drafter-raw.json").write_text(by_k(1.5, 1.52))
        assert levers.row(str(run)) == ("| run | **1.7000** | 1.7000 (step 600) | 0.500 | 0.400 | 6.00 | 9.00 / – / – / – "
                                        "| 1.550 / 1.600 | 1.6500, best 1.6800 (step 300); decoded 1.500 / 1.520 |")
        (run / "train_summary.json").write_text(json.dumps({**summary, "heldout": held}))  # a run without the average
        assert levers.row(str(run)).endswith("| 1.550 / 1.600 | – |")
    finally:
        del sys.modules["draftsmith_bench_levers"]


def test_the_data_curves_table_has_a_header_cell_for_every_cell_of_its_rows(tmp_path, capsys):
    """``data_curve.py table`` is levers' table with the point's sizes after the name: its header comes from
    ``levers.COLUMNS``, so a column levers adds (the EMA run's raw weights did) cannot leave its rows a cell longer."""
    curve = benchmark_script("data_curve")
    try:
        run = tmp_path / "r825"
        (run / "logs").mkdir(parents=True)
        held = {"heldout/top1_step0": 0.5, "heldout/expected_accept_step0": 0.4, "heldout/loss": 6.0, "sim_tau": 1.7}
        (run / "train_summary.json").write_text(json.dumps(
            {"heldout": held, "best": {"step": 150, "sim_tau": 1.7}, "steps": 150, "sim_tau_curve": []}))
        (run / "logs" / "train.rank0.jsonl").write_text(json.dumps({"step": 10, "loss": 9.0}) + "\n")
        (run / "data_curve.json").write_text(json.dumps({"records": 825, "answer_tokens": 110941, "steps": 150}))
        curve.table([str(run)])
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith("| point | records | answer tokens | steps | held-out sim τ |")
        assert lines[2] == ("| r825 | 825 | 110,941 | 150 | **1.7000** | 1.7000 (step 150) | 0.500 | 0.400 | 6.00 "
                            "| 9.00 / – / – / – | – | – |")
        assert len({line.count("|") for line in lines}) == 1
    finally:
        del sys.modules["draftsmith_bench_data_curve"]


# ---------------------------------------------------------------- the scripts' shared preamble


def test_the_scripts_take_the_target_option_from_their_shared_preamble():
    """``bench_common.script_parser(doc, target=True)`` is the one ``--target`` whose default is the builtin SmolLM2:
    a script that writes its own (``model_free.py`` did) drifts from it the day the default target changes."""
    import os
    import re

    import draftsmith

    folder = os.path.join(os.path.dirname(os.path.abspath(draftsmith.__file__)), "benchmarks")
    own = re.compile(r"add_argument\(\s*\"--target\",\s*default=(?!\"tiny\")")  # host_syncs' tiny stand-in is its own
    scripts = sorted(n for n in os.listdir(folder) if n.endswith(".py") and n != "bench_common.py")
    assert len(scripts) > 15 and "model_free.py" in scripts
    assert [n for n in scripts if own.search(open(os.path.join(folder, n), encoding="utf-8").read())] == []


def test_every_script_builds_its_parser_with_the_shared_preamble():
    """A script's parser is ``bench_common.script_parser``'s: its whole docstring as ``--help`` (levers.py, data_curve.py
    and peer.py printed its first line or paragraph only) and one place for what every parser shares."""
    import os

    import draftsmith

    folder = os.path.join(os.path.dirname(os.path.abspath(draftsmith.__file__)), "benchmarks")
    scripts = sorted(n for n in os.listdir(folder) if n.endswith(".py") and n != "bench_common.py")
    assert len(scripts) > 15 and "levers.py" in scripts
    assert [n for n in scripts if "ArgumentParser(" in open(os.path.join(folder, n), encoding="utf-8").read()] == []


def test_the_scripts_take_their_environment_and_result_file_from_the_shared_preamble(monkeypatch, tmp_path, capsys):
    """``bench_common.offline`` sets the environment of a script that loads the target (hub offline, tokenizers on one
    thread: the caller's own values kept) and its threads; ``save_result`` writes the JSON (its folder made) and says
    where. prepare.py, train.py and regen_server.py wrote the same three lines each, and five scripts their own result
    file."""
    import os

    import torch

    import draftsmith

    common = benchmark_script("bench_common")
    try:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
        before = torch.get_num_threads()
        try:
            common.offline(1)
            assert torch.get_num_threads() == 1
        finally:
            torch.set_num_threads(before)
        assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TOKENIZERS_PARALLELISM"] == "true"
        path = str(tmp_path / "out" / "r.json")
        common.save_result(path, {"load_after": (0.5, 1.0), "n": 3})
        assert json.load(open(path)) == {"load_after": [0.5, 1.0], "n": 3}
        assert capsys.readouterr().out == f"wrote {path}\n"
    finally:
        del sys.modules["draftsmith_bench_bench_common"]
    folder = os.path.join(os.path.dirname(os.path.abspath(draftsmith.__file__)), "benchmarks")
    texts = {n: open(os.path.join(folder, n), encoding="utf-8").read()
             for n in ("prepare.py", "train.py", "regen_server.py", "engine.py", "engine_cost.py")}
    assert [n for n, t in texts.items() if "HF_HUB_OFFLINE" in t or "wrote {" in t or "write_json" in t] == []


def run_main(module, argv: list[str], monkeypatch, *stubs: str) -> list[tuple]:
    """``module.main()`` with ``argv`` as the command line, each of ``stubs`` (the script's functions) recording its
    call instead of running."""
    calls: list[tuple] = []
    for name in stubs:
        monkeypatch.setattr(module, name, lambda *a, _name=name: calls.append((_name, *a)))
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    module.main()
    return calls


@pytest.mark.parametrize("name", ["levers", "data_curve", "peer"])
def test_a_scripts_help_is_its_docstring(name, capsys, monkeypatch):
    script = benchmark_script(name)
    try:
        usage = script.__doc__.split("\n\n")[1].splitlines()[0].strip()  # the docstring's first command line
        for argv in (["--help"], *([[sub, "--help"] for sub in ("train", "table")] if name != "peer" else [])):
            with pytest.raises(SystemExit) as e:
                run_main(script, argv, monkeypatch)
            assert e.value.code == 0
            out = capsys.readouterr().out
            if argv == ["--help"]:
                assert script.__doc__.splitlines()[0] in out and usage in out
            else:
                assert f"{argv[0]} [-h]" in out
    finally:
        del sys.modules[f"draftsmith_bench_{name}"]


def test_levers_takes_the_commands_of_results(monkeypatch):
    """The subcommands, options and defaults RESULTS' levers commands use: overrides before and after ``--only``."""
    levers = benchmark_script("levers")
    try:
        stubs = ("train", "decode", "table")
        assert run_main(levers, ["train", "cfg", "OUT", "a=1", "--only", "base,init_last", "b=2"], monkeypatch, *stubs) \
            == [("train", "cfg", "OUT", ["base", "init_last"], ["a=1", "b=2"])]
        assert run_main(levers, ["train", "cfg", "OUT"], monkeypatch, *stubs) == [("train", "cfg", "OUT", None, [])]
        assert run_main(levers, ["decode", "R1", "R2"], monkeypatch, *stubs) == \
            [("decode", ["R1", "R2"], 20, [3, 4], 96, "mtbench")]
        assert run_main(levers, ["decode", "R", "--prompts", "80", "--ks", "4", "--max-new-tokens", "64", "--questions",
                                 "H.jsonl"], monkeypatch, *stubs) == [("decode", ["R"], 80, [4], 64, "H.jsonl")]
        assert run_main(levers, ["table", "R1", "R2"], monkeypatch, *stubs) == [("table", ["R1", "R2"])]
        with pytest.raises(SystemExit) as e:
            run_main(levers, ["table", "R1", "--prompts", "3"], monkeypatch, *stubs)
        assert e.value.code == 2
    finally:
        del sys.modules["draftsmith_bench_levers"]


def test_data_curve_takes_the_commands_of_results(monkeypatch):
    curve = benchmark_script("data_curve")
    try:
        assert run_main(curve, ["train", "cfg", "OUT", "--records", "0,825,196", "a=1", "--epochs", "3", "b=2"],
                        monkeypatch, "train", "table") == [("train", "cfg", "OUT", [0, 825, 196], 3.0, 150, ["a=1", "b=2"])]
        assert run_main(curve, ["train", "cfg", "OUT", "--records", "196", "--min-steps", "100"], monkeypatch, "train") == \
            [("train", "cfg", "OUT", [196], 4.0, 100, [])]
        assert run_main(curve, ["table", "R1", "R2"], monkeypatch, "table") == [("table", ["R1", "R2"])]
        with pytest.raises(SystemExit) as e:
            run_main(curve, ["train", "cfg", "OUT"], monkeypatch, "train")  # --records is required
        assert e.value.code == 2
    finally:
        del sys.modules["draftsmith_bench_data_curve"]


def test_peer_takes_the_options_of_results(monkeypatch, tmp_path):
    peer = benchmark_script("peer")

    class Parsed(Exception):
        pass

    def stop(args, *_):
        raise Parsed(vars(args) if isinstance(args, argparse.Namespace) else args)

    try:
        monkeypatch.setattr(peer, "recipe_for", stop)
        out = str(tmp_path / "peer")
        with pytest.raises(Parsed) as e:
            run_main(peer, ["--prepared", "P", "--draftsmith-run", "R", "--out", out], monkeypatch)
        assert e.value.args[0] == {"prepared": "P", "draftsmith_run": "R", "out": out, "draft_vocab": "",
                                   "steps": None, "batch_size": None,
                                   "ttt_steps": None, "lr": None, "seed": None, "prompts": 20, "k": 4, "max_new_tokens": 96,
                                   "speculators_defaults": False, "no_decoder": False}
        with pytest.raises(Parsed) as e:
            run_main(peer, ["--prepared", "P", "--out", out, "--steps", "150", "--batch-size", "8", "--ttt-steps", "2",
                            "--lr", "2e-3", "--seed", "1", "--speculators-defaults", "--no-decoder"], monkeypatch)
        got = e.value.args[0]
        assert (got["steps"], got["batch_size"], got["ttt_steps"], got["lr"], got["seed"], got["draftsmith_run"]) == (
            150, 8, 2, 2e-3, 1, "")
        assert got["speculators_defaults"] and got["no_decoder"]
        with pytest.raises(SystemExit) as e:
            run_main(peer, ["--out", out], monkeypatch)  # --prepared is required
        assert e.value.code == 2
        monkeypatch.undo()
        # the recipe both trainers follow: --prepared's records and features, its vocabulary unless --draft-vocab
        prepared = tmp_path / "run" / "prepare" / "data"
        args = peer.argparse.Namespace(prepared=str(prepared), draftsmith_run="", draft_vocab="", steps=600, batch_size=8,
                                       ttt_steps=2, lr=2e-3, seed=None)
        recipe = peer.recipe_for(args)
        assert recipe.drafter.draft_vocab == f"{prepared}/draft_vocab.safetensors"
        assert (recipe.train.dataset, recipe.train.features) == (f"{prepared}/tokenized", f"{prepared}/features")
        assert (recipe.train.steps, recipe.train.batch_size, recipe.train.ttt_steps) == (600, 8, 2)
        assert recipe.train.schedule.warmup_steps == 12
        assert (recipe.train.seed, recipe.drafter.seed) == (0, 0)
        args.seed = 1  # a second seed: the split, the batch order and speculators' own
        assert (peer.recipe_for(args).train.seed, peer.recipe_for(args).drafter.seed) == (1, 1)
        args.draft_vocab = str(tmp_path / "full" / "draft_vocab.safetensors")
        assert peer.recipe_for(args).drafter.draft_vocab == args.draft_vocab
        # the recipe is kept beside the heads, as a run folder keeps its own (levers.py decode reads it)
        monkeypatch.setattr(peer, "load_target", stop)
        with pytest.raises(Parsed):
            run_main(peer, ["--prepared", str(prepared), "--out", out, "--steps", "600", "--seed", "1"], monkeypatch)
        kept = peer.load_recipe(os.path.join(out, "config.yaml"), [])
        assert (kept.train.dataset, kept.train.steps, kept.train.seed) == (f"{prepared}/tokenized", 600, 1)
    finally:
        del sys.modules["draftsmith_bench_peer"]


def test_engine_flags_reads_its_rows_and_prints_its_docstring(capsys, monkeypatch):
    script = benchmark_script("engine_flags")
    try:
        assert script.parse_row("k2 td1=1:2:0.5:-td 1 -tbd 1") == ("k2 td1", 1, 2, 0.5, ("-td", "1", "-tbd", "1"))
        assert script.parse_row("k1=0:1:0") == ("k1", 0, 1, 0.0, ())
        for bad in ("k1", "k1=0:1", "=0:1:0.5"):
            with pytest.raises(SystemExit, match="NAME=HEAD:K:P_MIN"):
                script.parse_row(bad)
        with pytest.raises(SystemExit) as e:
            run_main(script, ["--help"], monkeypatch)
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert script.__doc__.splitlines()[0] in out and "--row" in out
        with pytest.raises(SystemExit) as e:
            run_main(script, ["--drafters", "x"], monkeypatch)
        assert e.value.code == 2 and "give at least one --row" in capsys.readouterr().err
    finally:
        del sys.modules["draftsmith_bench_engine_flags"]


def test_engine_flags_pairs_the_rows_of_one_k():
    script = benchmark_script("engine_flags")
    try:
        rows = [("a", 0, 2, 0.5, ()), ("b", 1, 2, 0.5, ()), ("c", 1, 3, 0.5, ())]
        methods = {"a": {"per_prompt_speedup": [1.0, 1.2, 0.9]}, "b": {"per_prompt_speedup": [1.0, 1.0, 1.0]},
                   "c": {"per_prompt_speedup": [2.0, 2.0, 2.0]}}
        pairs = script.paired(rows, methods)
        assert list(pairs) == ["a / b"]
        median, (lo, hi) = pairs["a / b"]
        assert median == 1.0 and 0.9 <= lo <= 1.0 <= hi <= 1.2
    finally:
        del sys.modules["draftsmith_bench_engine_flags"]


def test_engine_cost_reads_llama_benchs_forwards_in_target_steps():
    script = benchmark_script("engine_cost")
    try:
        def run(step, forwards):  # ns per decoded token; ns per forward over n = 1, 2, 3 tokens
            return [{"n_prompt": n, "n_gen": 0, "avg_ns": ns} for n, ns in enumerate(forwards, 1)] + \
                [{"n_prompt": 0, "n_gen": 64, "avg_ns": 64 * step}]
        # each ratio is taken inside its run: a run at half the speed gives the same costs
        runs = [run(20e6, [21e6, 26e6, 29e6]), run(40e6, [42e6, 52e6, 58e6]), run(20e6, [20e6, 30e6, 40e6])]
        assert script.forward_costs(runs) == {1: 1.05, 2: 1.3, 3: 1.45}
        with pytest.raises(ValueError, match="one decode record"):
            script.forward_costs([runs[0][:3]])
        assert script.NO_DRAFTS > 1.0  # a draft probability never reaches it: the row drafts nothing
    finally:
        del sys.modules["draftsmith_bench_engine_cost"]


def test_matched_draft_types_are_bf16_on_a_bf16_target_and_f32_on_any_other():
    common = benchmark_script("bench_common")
    try:
        assert common.draft_types("matched", "bf16") == ["bf16"]
        assert common.draft_types("matched", "f32") == common.draft_types("matched", "as-loaded") == ["f32"]
        assert common.draft_types("auto,q8_0", "bf16") == ["auto", "q8_0"]
    finally:
        del sys.modules["draftsmith_bench_bench_common"]
