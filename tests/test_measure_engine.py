"""The bookkeeping of the llama.cpp sweep (``measure/engine.py``, ``measure/engine_eval.py``) without a server: one
llama-server per (k, p-min) with the gate on its command line, τ per target forward when the gate drafts nothing,
the fastest setting chosen by the median per-prompt speedup and called clearly best only when the paired ratios
say so, and the setting written into the export's metadata and the command printed for it.

Rows are built from fabricated completions: their token counts and wall times are the measurement."""

from __future__ import annotations

import json
import shlex

import pytest

from draftsmith.cli import main
from draftsmith.engines.llamacpp import Completion, EngineRun
from draftsmith.errors import ConfigError
from draftsmith.measure.config import EvalConfig
from draftsmith.measure import engine
from draftsmith.measure.engine import TARGET, Method, best_setting, methods, row, table


def run(tokens: int, secs: float, rounds: list[tuple[int, int]] | None = None) -> EngineRun:
    return EngineRun(Completion(tokens=list(range(tokens)), stop_type="limit", prompt_n=5, prompt_ms=1.0,
                                predicted_n=tokens, predicted_ms=1000.0 * secs, wall_s=secs), rounds or [])


def fabricate(todo: list[Method], secs: dict[str, list[float]], tokens: int = 10) -> dict:
    """The result of ``measure_methods`` for ``todo`` where method NAME decoded each prompt's ``tokens`` in
    ``secs[NAME][i]`` seconds (the target alone in 1 s)."""
    alone = [run(tokens, 1.0) for _ in secs[next(iter(secs))]]
    rows = {TARGET: row(todo[0], alone, [1.0] * len(alone), alone, [1.0] * len(alone))}
    for m in todo[1:]:
        runs = [run(tokens, s, [(1, m.k)] * 3) for s in secs[m.name]]
        rows[m.name] = row(m, runs, secs[m.name], alone, [1.0] * len(alone))
    return {"methods": rows, "threads": 2, "repeats": 1, "warmup": 1, "prompts": len(alone), "max_new_tokens": tokens,
            "llama_cpp": "11434.0.0", "target_type": "f32"}


def test_each_k_and_p_min_is_its_own_server_with_the_gate_on_its_command_line():
    todo = methods("t.gguf", "d.gguf", "eagle3", ks=[1, 2], threads=2, ngram=["ngram-simple"], hybrid=True,
                   p_mins=[0.0, 0.5])
    assert [m.name for m in todo] == ["target", "drafter k=1", "drafter k=1 p-min=0.5", "drafter k=2",
                                      "drafter k=2 p-min=0.5", "drafter+ngram k=2", "ngram-simple"]
    args = {m.name: m.spec.args() for m in todo}

    def flag(name: str, option: str) -> str | None:
        a = args[name]
        return a[a.index(option) + 1] if option in a else None

    assert flag("drafter k=2 p-min=0.5", "--spec-draft-p-min") == "0.5"
    assert flag("drafter k=2 p-min=0.5", "--spec-draft-n-max") == "2"
    assert flag("drafter k=1", "--spec-draft-p-min") == "0"
    assert flag("target", "--spec-draft-p-min") is None and flag("ngram-simple", "--spec-draft-p-min") is None


def test_several_draft_ggufs_are_swept_side_by_side_and_the_best_names_its_own():
    todo = methods("t.gguf", {"f32": "d32.gguf", "bf16": "d16.gguf"}, "eagle3", ks=[1], threads=2, ngram=[],
                   hybrid=True, p_mins=[0.0, 0.5])
    assert [(m.name, m.spec.draft) for m in todo] == [
        ("target", None), ("drafter k=1 [f32]", "d32.gguf"), ("drafter k=1 p-min=0.5 [f32]", "d32.gguf"),
        ("drafter k=1 [bf16]", "d16.gguf"), ("drafter k=1 p-min=0.5 [bf16]", "d16.gguf"),
        ("drafter+ngram k=1", "d32.gguf")]
    speeds = {"target": [1.0] * 5, "drafter k=1 [f32]": [1 / 0.85] * 5, "drafter k=1 p-min=0.5 [f32]": [1 / 0.95] * 5,
              "drafter k=1 [bf16]": [1 / 0.90] * 5, "drafter k=1 p-min=0.5 [bf16]": [1 / 0.99] * 5,
              "drafter+ngram k=1": [1 / 0.80] * 5}
    best = best_setting(fabricate(todo, speeds))
    assert (best["method"], best["draft_label"], best["k"], best["p_min"]) == \
        ("drafter k=1 p-min=0.5 [bf16]", "bf16", 1, 0.5)
    assert "k = 1, p-min 0.5, drafter bf16: 0.99x" in engine.describe_best(best)
    assert best_setting(fabricate(methods("t.gguf", "d.gguf", "eagle3", ks=[1], threads=2, ngram=[], hybrid=False),
                                  {"target": [1.0] * 5, "drafter k=1": [1.0] * 5}))["draft_label"] == ""


def test_a_step_the_gate_left_undrafted_counts_as_a_round_of_tau_one():
    m = Method("drafter k=2 p-min=0.5", engine.llamacpp.ServerSpec("t", draft="d", spec_type="draft-eagle3", n_max=2,
                                                                    p_min=0.5), 2)
    alone = [run(11, 1.0)]
    # 11 tokens: the prefill's, 2 rounds that accepted 1 draft each (2 tokens each), and 6 steps with no draft
    r = row(m, [run(11, 1.0, [(1, 2), (1, 2)])], [1.0], alone, [1.0])
    assert r["undrafted_rounds"] == 6 and r["rounds"] == 8
    assert r["tau"] == pytest.approx(10 / 8)  # tokens after the prefill per target forward
    assert r["acceptance_at_position"] == [1.0, 0.0]  # of the rounds that drafted
    assert r["k"] == 2 and r["p_min"] == 0.5


SPEEDS = {  # seconds per prompt (the target alone: 1 s) → speedup 1/s
    "target": [1.0] * 5,
    "drafter k=1": [1 / 0.80, 1 / 0.82, 1 / 0.78, 1 / 0.81, 1 / 0.79],
    "drafter k=1 p-min=0.5": [1 / 0.90, 1 / 0.91, 1 / 0.89, 1 / 0.92, 1 / 0.88],
    "drafter k=2": [1 / 0.60] * 5,
    "drafter k=2 p-min=0.5": [1 / 0.70] * 5,
}


def test_the_fastest_setting_is_chosen_and_clearly_ahead_only_when_every_prompt_says_so():
    todo = methods("t.gguf", "d.gguf", "eagle3", ks=[1, 2], threads=2, ngram=[], hybrid=False, p_mins=[0.0, 0.5])
    best = best_setting(fabricate(todo, SPEEDS))
    assert (best["method"], best["k"], best["p_min"], best["target_type"]) == ("drafter k=1 p-min=0.5", 1, 0.5, "f32")
    assert best["speedup"] == pytest.approx(0.90, abs=1e-3) and not best["pays"]
    assert best["runner_up"]["method"] == "drafter k=1" and best["clearly_best"]  # ~1.12× on every prompt

    close = dict(SPEEDS)  # the same median, but the runner-up wins on two prompts of five
    close["drafter k=1"] = [1 / 0.95, 1 / 0.95, 1 / 0.80, 1 / 0.81, 1 / 0.79]
    best = best_setting(fabricate(todo, close))
    assert best["method"] == "drafter k=1 p-min=0.5" and not best["clearly_best"]
    assert "not clearly ahead of the runner-up drafter k=1" in engine.describe_best(best)

    assert best_setting(fabricate(todo[:1], {"target": [1.0] * 3})) is None  # no drafter, no setting


def test_measure_records_the_best_with_the_command_that_serves_it(monkeypatch):
    monkeypatch.setattr(engine, "measure_methods",
                        lambda todo, *a, **k: {**fabricate(todo, SPEEDS), "target_type": None})
    result = engine.measure("/m/target.gguf", [[1, 2]] * 5, 10, draft_gguf="/m/draft.gguf", family="eagle3",
                            ks=[1, 2], threads=3, ngram=[], hybrid=False, p_mins=[0.0, 0.5], target_type="bf16")
    best = result["best"]
    assert best["target_type"] == "bf16"
    cmd = shlex.split(best["command"])
    assert cmd[0].endswith("llama-server")
    for option, value in (("-m", "/m/target.gguf"), ("-md", "/m/draft.gguf"), ("--spec-type", "draft-eagle3"),
                          ("--spec-draft-n-max", "1"), ("--spec-draft-p-min", "0.5"), ("-t", "3")):
        assert cmd[cmd.index(option) + 1] == value, option
    printed = table(result)
    assert "best served setting (bf16 target): k = 1, p-min 0.5: 0.90x" in printed.replace("\n  ", " ")
    assert printed.splitlines()[-1] == best["command"]
    assert all(len(line) <= 80 for line in printed.splitlines()[:-1])


def test_the_served_measurement_gets_its_gguf_from_the_writer_it_is_handed(monkeypatch, tmp_path):
    """``eval.engine=llamacpp`` (``measure.engine_eval``): the saved drafter is written by the stage's writer into
    ``<run_dir>/engine/draft`` for the recipe's target, measured at decode.k when eval.engine_k is empty, and the best
    setting goes back through the GGUF's own ``record``; a drafter that is not saved is refused before anything is
    written."""
    from types import SimpleNamespace

    from draftsmith.measure import engine_eval
    from draftsmith.measure.config import DecodeConfig

    written, measured, recorded = [], {}, []

    def write_gguf(drafter: str, out: str, target: str, gguf_type: str) -> engine_eval.DraftGGUF:
        written.append((drafter, out, target, gguf_type))
        return engine_eval.DraftGGUF(f"{out}/draft.gguf", "dflash", "bf16", lambda *a: recorded.append(a))

    def fake_measure(target_file, prompts, max_new_tokens, **kw):
        measured.update(kw, target_file=target_file, prompts=prompts, max_new_tokens=max_new_tokens)
        return {"best": {"method": "drafter k=3"}}

    monkeypatch.setattr(engine_eval, "measure", fake_measure)
    monkeypatch.setattr(engine_eval, "target_gguf_for", lambda spec, kind, target: f"/cache/{spec}-{kind}.gguf")
    recipe = SimpleNamespace(run_dir=str(tmp_path), target=SimpleNamespace(name="tiny"),
                             drafter=SimpleNamespace(type="saved", path="/runs/d"),
                             decode=DecodeConfig(k=3, max_new_tokens=7),
                             eval=EvalConfig(engine="llamacpp", engine_draft_type="bf16", engine_threads=2))
    result = engine_eval.evaluate_in_llamacpp(recipe, [[1, 2]], None, write_gguf)
    assert written == [("/runs/d", f"{tmp_path}/engine/draft", "tiny", "bf16")]
    assert (measured["target_file"], measured["draft_gguf"], measured["family"]) == (
        "/cache/tiny-as-loaded.gguf", f"{tmp_path}/engine/draft/draft.gguf", "dflash")
    assert (measured["ks"], measured["p_mins"], measured["threads"], measured["max_new_tokens"]) == (
        [3], [0.0, 0.5], 2, 7)
    assert result["draft_type"] == "bf16"
    assert recorded == [({"method": "drafter k=3"}, "draftsmith eval (eval.engine=llamacpp)", 7)]

    unsaved = SimpleNamespace(**{**vars(recipe), "drafter": SimpleNamespace(type="prompt_lookup")})
    with pytest.raises(ConfigError, match="set drafter.type=saved"):
        engine_eval.evaluate_in_llamacpp(unsaved, [[1, 2]], None, write_gguf)
    assert len(written) == 1


def export_folder(tmp_path, family: str = "eagle3") -> str:
    folder = tmp_path / "gguf"
    folder.mkdir()
    info = {"format": "draftsmith-export", "format_version": 1, "to": "gguf", "source": {"family": family},
            "gguf": {"file": "draft.gguf", "type": "f32", "spec_type": "draft-eagle3"}}
    (folder / "draftsmith_export.json").write_text(json.dumps(info))
    return str(folder)


def test_the_best_setting_is_written_into_the_export_and_its_command_printed(tmp_path):
    from draftsmith.export.served import record_best, serve_command

    folder = export_folder(tmp_path)
    info = json.loads((tmp_path / "gguf" / "draftsmith_export.json").read_text())
    unmeasured = serve_command(folder, info)
    assert "unmeasured" in unmeasured and "-m TARGET.gguf" in unmeasured and "--spec-draft-n-max 1" in unmeasured

    todo = methods("/m/t.gguf", f"{folder}/draft.gguf", "eagle3", ks=[1, 2], threads=2, ngram=[], hybrid=False,
                   p_mins=[0.0, 0.5])
    best = best_setting(fabricate(todo, SPEEDS))
    best["command"] = engine.command(todo[2].spec)
    record_best(f"{folder}/draftsmith_export.json", best, "a test", 10)
    info = json.loads((tmp_path / "gguf" / "draftsmith_export.json").read_text())
    served = info["gguf"]["served"]
    assert (served["k"], served["p_min"], served["target_type"], served["measured_by"]) == (1, 0.5, "f32", "a test")
    assert info["to"] == "gguf" and info["gguf"]["spec_type"] == "draft-eagle3"  # the rest kept
    printed = serve_command(folder, info)
    assert "unmeasured" not in printed and "k = 1, p-min 0.5" in printed
    assert printed.endswith(best["command"]) and "--spec-draft-p-min 0.5" in printed


def test_the_sweeps_settings_are_validated_where_they_are_given(capsys):
    EvalConfig(engine_p_min=[0.0, 0.5]).validate()
    for bad in ([], [1.0], [-0.1]):
        with pytest.raises(ConfigError, match="eval.engine_p_min"):
            EvalConfig(engine_p_min=bad).validate()
    assert main(["export", "--check", "nowhere", "--p-min", "1.5"]) == 2
    assert "--p-min: each in [0, 1)" in capsys.readouterr().err
    assert main(["export", "--check", "nowhere", "--target-type", "q4"]) == 2
    assert "--target-type 'q4'" in capsys.readouterr().err
    assert main(["export", "src", "--to", "gguf", "--out", "o", "--k", "1,2"]) == 2
    assert "go with --check" in capsys.readouterr().err


@pytest.mark.parametrize("ks, checked", [(None, 3), ("4", 4), ("1,4,2", 4), ("1", 1)])
def test_the_engine_check_compares_acceptance_at_the_largest_k_given(monkeypatch, ks, checked):
    """``export --check --k 4`` of a GGUF export proves acceptance by position at k = 4 (it did at 3 whatever --k
    said), and serves the ks given; without --k, at 3 and the default sweep. The parts that need llama.cpp are
    stood in for: what is checked here is the k each is handed (tests/test_engines_llamacpp.py runs them)."""
    from draftsmith.cli import sweep_of
    from draftsmith.export import gguf, run

    handed = {}
    monkeypatch.setattr(run, "_source_of", lambda info, folder, target: "source")
    monkeypatch.setattr(run, "check_gguf_bytes", lambda folder, name, info: [])
    monkeypatch.setattr(gguf, "static_check", lambda *a: [])
    monkeypatch.setattr(gguf, "engine_check", lambda folder, target, source, prompts, k: handed.setdefault("check", k)
                        and [])
    monkeypatch.setattr(run, "sweep_export", lambda folder, info_file, target, source, prompts, sweep:
                        handed.setdefault("served", sweep.ks) and [])
    sweep = sweep_of({"ks": ks, "p_mins": None, "target_type": None, "threads": None})
    run.check_gguf("folder", {}, "target", [[1, 2]], [], sweep)
    assert handed == {"check": checked, "served": tuple(int(k) for k in ks.split(",")) if ks else (1, 2)}
