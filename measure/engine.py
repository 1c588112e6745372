"""A drafter's speedup where it is served: llama.cpp against llama.cpp's target alone.

:func:`measure` decodes a prompt set through several ``llama-server`` configurations of one target GGUF — the
target alone, the drafter at each draft length k, llama.cpp's own model-free methods
(``engines.llamacpp.NGRAM_METHODS``) and the drafter mixed with ``ngram-simple`` (llama.cpp lets a draft model and an
n-gram method run together: the n-gram draft wins where it has one) — greedy, with the same build, the same
threads and the same prompts, in paired runs as the built-in decoder's evaluation times them
(``measure.paired.paired_runs``: every prompt through every method, the order rotating from run to run, each method's
fastest run counted, after a warm-up). Per method: τ (bonus token counted, from the server's per-round log),
acceptance by position, tokens/s, the median of per-prompt speedups against the target alone with its 90 %
bootstrap interval, how many outputs are identical to the target alone's, and the engine's cost of one round
(drafting + verification, from llama.cpp's decode timings) in target-alone steps — the τ at which the method
breaks even there.

All servers run at once, each idle while another decodes (an idle ``llama-server`` sleeps: measured 0 % CPU), so
that one prompt passes through every configuration back to back. ``ngram-mod`` keeps its n-gram pool across
requests, and a repeated prompt would be drafted from its own earlier answer: it runs on a fresh server, each
prompt once, no warm-up — first sight only. Time is the client's wall clock per request (prefill included, the
draft model's too).

The drafter is swept over draft lengths k and llama.cpp's confidence gate ``--spec-draft-p-min`` (drafting stops
at the first position whose top draft probability is below it), one server per (k, p-min); :func:`best_setting`
picks the fastest (the highest median per-prompt speedup) and says, from the paired per-prompt ratios of the two,
whether it is clearly ahead of the runner-up (the 90 % interval of their ratio above 1). A round in which the gate
or an n-gram method drafted nothing is a plain target step: it counts as a round of 0 drafts (τ 1), as the
built-in decoder counts its gated rounds, so τ is per target forward for every method.
"""

from __future__ import annotations

import shlex
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..engines import llamacpp
from ..engines.llamacpp import NGRAM_METHODS
from ..errors import DraftsmithError
from ..tables import wrapped
from .costs import median_interval
from .paired import paired_runs

TARGET = "target"
FIRST_SIGHT = {"ngram-mod"}
"""Methods whose state outlives a request: measured once per prompt on a fresh server."""


@dataclass(frozen=True)
class Method:
    name: str
    spec: llamacpp.ServerSpec
    k: int = 0
    draft_label: str = ""
    """Which of several draft GGUFs it serves (its tensor type, say), when one measurement compares them."""


def drafter_name(k: int, p_min: float) -> str:
    """The row of the drafter at draft length k behind the gate p-min (``drafter k=2``, ``drafter k=2 p-min=0.5``)."""
    return f"drafter k={k}" + (f" p-min={p_min:g}" if p_min > 0 else "")


def methods(target_gguf: str, draft_gguf: str | Mapping[str, str] | None, family: str | None, ks: Sequence[int],
            threads: int, ngram: Sequence[str] = NGRAM_METHODS, hybrid: bool = True, n_max_ngram: int = 16,
            p_mins: Sequence[float] = (0.0,)) -> list[Method]:
    """The configurations :func:`measure` compares (the target alone first): the drafter at every (k, p-min).
    ``draft_gguf`` may map labels to several GGUFs of one drafter (its tensor types): each is swept, its rows
    named with `` [label]``, in the same paired runs; the mix with ngram-simple serves the first."""
    base = dict(model=target_gguf, threads=threads)
    out = [Method(TARGET, llamacpp.ServerSpec(**base))]
    drafts = dict(draft_gguf) if isinstance(draft_gguf, Mapping) else {"": draft_gguf} if draft_gguf else {}
    kind = llamacpp.SPEC_TYPES[family or "eagle3"]
    for label, draft in drafts.items():
        tag = f" [{label}]" if len(drafts) > 1 else ""
        out += [Method(drafter_name(k, p) + tag, llamacpp.ServerSpec(**base, draft=draft, spec_type=kind, n_max=k,
                                                                     p_min=p), k, label)
                for k in ks for p in p_mins]
    if drafts and hybrid:
        (label, draft), k = next(iter(drafts.items())), max(ks)
        out.append(Method(f"drafter+ngram k={k}", llamacpp.ServerSpec(
            **base, draft=draft, spec_type=f"{kind},ngram-simple", n_max=k), k, label))
    out += [Method(name, llamacpp.ServerSpec(**base, spec_type=name, n_max=n_max_ngram), n_max_ngram) for name in ngram]
    return out


def measure(target_gguf: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
            draft_gguf: str | Mapping[str, str] | None = None,
            family: str | None = None, ks: Sequence[int] = (1, 2, 3, 4), threads: int = 1, repeats: int = 2,
            warmup: int = 1, ngram: Sequence[str] = NGRAM_METHODS, hybrid: bool = True,
            progress: Any = None, p_mins: Sequence[float] = (0.0,), target_type: str | None = None) -> dict[str, Any]:
    """Every method of :func:`methods` over ``prompts`` (token ids); returns name → its row (module docstring),
    and under "best" the drafter's fastest setting (:func:`best_setting`) with the ``llama-server`` command that
    serves it. target_type: the target GGUF's type, recorded with the best setting (it decides what can pay)."""
    todo = methods(target_gguf, draft_gguf, family, ks, threads, ngram, hybrid, p_mins=p_mins)
    result = measure_methods(todo, prompts, max_new_tokens, repeats, warmup, progress)
    result.update(threads=threads, target_gguf=target_gguf, draft_gguf=draft_gguf, target_type=target_type)
    best = best_setting(result)
    if best is not None:
        best["command"] = command(next(m.spec for m in todo if m.name == best["method"]))
        result["best"] = best
    return result


def best_setting(result: dict[str, Any]) -> dict[str, Any] | None:
    """The drafter's fastest measured setting among the rows of :func:`measure` that serve it (every k and p-min,
    and the drafter mixed with ngram-simple): the highest median per-prompt speedup against the target alone.
    ``clearly_best`` says whether it is ahead of the runner-up beyond noise: the 90 % interval of the median of
    their paired per-prompt ratios (the same prompts, the same target-alone runs) lies above 1. ``pays``: its own
    interval lies above 1×. None without a drafter."""
    rows = {name: r for name, r in result["methods"].items() if "p_min" in r}
    if not rows:
        return None
    ranked = sorted(rows, key=lambda name: rows[name]["speedup"], reverse=True)
    r = rows[ranked[0]]
    best: dict[str, Any] = {"method": ranked[0], "spec_type": r["spec_type"], "k": r["k"], "p_min": r["p_min"],
                            "target_type": result.get("target_type"), "speedup": r["speedup"], "interval": r["interval"],
                            "pays": r["interval"][0] > 1.0, "tau": r.get("tau"),
                            "draft_label": r.get("draft_label", ""), "identical_to_target": r["identical_to_target"],
                            "prompts": result["prompts"],
                            "threads": result["threads"], "llama_cpp": result["llama_cpp"], "runner_up": None,
                            "clearly_best": len(ranked) == 1}
    if len(ranked) > 1:
        other = rows[ranked[1]]
        ratios = [a / b for a, b in zip(r["per_prompt_speedup"], other["per_prompt_speedup"])]
        lo, hi = median_interval(ratios)
        best["runner_up"] = {"method": ranked[1], "speedup": other["speedup"], "interval": other["interval"],
                             "best_over_it": round(statistics.median(ratios), 4),
                             "best_over_it_interval": [round(lo, 4), round(hi, 4)]}
        best["clearly_best"] = lo > 1.0
    return best


def command(spec: llamacpp.ServerSpec) -> str:
    """The ``llama-server`` command line that serves ``spec`` as it was measured (add --host / --port)."""
    try:
        binary = llamacpp.binaries(build=False).tool("llama-server")
    except DraftsmithError:
        binary = "llama-server"
    return shlex.join([binary, *spec.args()])


def describe_best(best: dict[str, Any]) -> str:
    """One line: the best setting, its speedup, and how sure the choice is."""
    gate = f"p-min {best['p_min']:g}" if best["p_min"] > 0 else "no p-min gate"
    mixed = " mixed with ngram-simple" if "," in (best["spec_type"] or "") else ""
    draft = f", drafter {best['draft_label']}" if best.get("draft_label") else ""
    lo, hi = best["interval"]
    line = (f"best served setting ({best['target_type'] or 'this'} target): k = {best['k']}, {gate}{mixed}{draft}: "
            f"{best['speedup']:.2f}x [{lo:.2f}-{hi:.2f}] vs the target alone")
    if not best["pays"]:
        line += " (not faster than the target alone" + (": serve the target alone)" if hi < 1.0 else " beyond noise)")
    up = best["runner_up"]
    if up is not None:
        ahead = "clearly ahead of" if best["clearly_best"] else "not clearly ahead of"
        line += (f"; {ahead} the runner-up {up['method']} ({up['speedup']:.2f}x; paired ratio {up['best_over_it']:.3f} "
                 f"[{up['best_over_it_interval'][0]:.3f}-{up['best_over_it_interval'][1]:.3f}])")
    return line


def measure_methods(todo: Sequence[Method], prompts: Sequence[Sequence[int]], max_new_tokens: int, repeats: int = 2,
                    warmup: int = 1, progress: Any = None) -> dict[str, Any]:
    """Any list of methods (the target alone first, named :data:`TARGET`) over ``prompts``, timed as :func:`measure`
    times them; returns name → its row."""
    paired = [m for m in todo if m.name not in FIRST_SIGHT]
    outputs: dict[str, list[llamacpp.EngineRun]] = {m.name: [] for m in todo}
    seconds: dict[str, list[float]] = {m.name: [] for m in todo}
    servers: dict[str, llamacpp.Server] = {}
    try:
        for m in paired:
            servers[m.name] = llamacpp.Server(m.spec, trace=m.k > 0).start()

        def runner(name: str):
            server = servers[name]

            def run(ids: list[int]) -> tuple[llamacpp.EngineRun, float]:
                got = llamacpp.decode_prompts(server, [ids], max_new_tokens)[0]
                return got, got.completion.wall_s
            return run

        calls = {m.name: runner(m.name) for m in paired}
        for ids in list(prompts)[:warmup]:
            for run in calls.values():
                run(list(ids))
        for i, ids in enumerate(prompts):
            got = paired_runs(calls, list(ids), repeats, start=i * repeats)
            for name, ((run, secs), _) in got.items():
                outputs[name].append(run)
                seconds[name].append(secs)
            if progress:
                progress(i + 1, len(prompts))
    finally:
        for server in servers.values():
            server.stop(failed=sys.exc_info()[0] is not None)  # a failed run keeps the servers' logs
    for m in todo:
        if m.name in FIRST_SIGHT:
            with llamacpp.serving(m.spec, trace=True) as server:
                for ids in prompts:
                    run = llamacpp.decode_prompts(server, [list(ids)], max_new_tokens)[0]
                    outputs[m.name].append(run)
                    seconds[m.name].append(run.completion.wall_s)
    rows = {}
    alone = outputs[TARGET]
    for m in todo:
        rows[m.name] = row(m, outputs[m.name], seconds[m.name], alone, seconds[TARGET])
    return {"methods": rows, "threads": todo[0].spec.threads, "repeats": repeats, "warmup": warmup,
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "llama_cpp": llamacpp.LLAMA_CPP_BIN}


def row(m: Method, runs: list[llamacpp.EngineRun], secs: list[float], alone: list[llamacpp.EngineRun],
        alone_secs: list[float]) -> dict[str, Any]:
    tokens = sum(len(r.completion.tokens) for r in runs)
    out: dict[str, Any] = {"new_tokens": tokens, "tokens_per_s": round(tokens / sum(secs), 3),
                           "identical_to_target": sum(r.completion.tokens == a.completion.tokens
                                                      for r, a in zip(runs, alone)),
                           "first_sight_only": m.name in FIRST_SIGHT, "spec_type": m.spec.spec_type}
    if m.name == TARGET:
        return out
    if m.spec.draft:
        out.update(k=m.k, p_min=m.spec.p_min, **({"draft_label": m.draft_label} if m.draft_label else {}))
    ratios = [(len(r.completion.tokens) / s) / (len(a.completion.tokens) / t)
              for r, s, a, t in zip(runs, secs, alone, alone_secs)]
    lo, hi = median_interval(ratios)
    out.update(speedup=round(statistics.median(ratios), 4), interval=[round(lo, 4), round(hi, 4)],
               per_prompt_speedup=[round(x, 4) for x in ratios],
               speedup_total=round((tokens / sum(secs)) / (sum(len(a.completion.tokens) for a in alone) / sum(alone_secs)), 4))
    stats = llamacpp.rounds_stats(runs, m.k)
    undrafted = undrafted_steps(runs)
    for _ in range(undrafted):  # target steps with no draft (the gate stopped it, no n-gram matched)
        stats.record_round(0, 0)
    if stats.rounds:
        # the engine's cost of a round (drafting + verifying) in target-alone decode steps, from llama.cpp's own
        # decode timings: the τ at which this method breaks even (speedup ≈ τ / round cost)
        step = sum(a.completion.predicted_ms for a in alone) / max(1, sum(a.completion.predicted_n for a in alone))
        decode_ms = sum(r.completion.predicted_ms for r in runs)
        cost = decode_ms / stats.rounds / step if step > 0 else None
        out.update(k=m.k, tau=round(stats.tau, 4), rounds=stats.rounds, undrafted_rounds=undrafted, drafted=stats.drafted,
                   accepted=stats.accepted,
                   acceptance_at_position=[None if x is None else round(x, 4) for x in stats.acceptance_at_position],
                   round_cost_steps=None if cost is None else round(cost, 4),
                   break_even_tau=None if cost is None else round(cost, 4))
    return out


def undrafted_steps(runs: Sequence[llamacpp.EngineRun]) -> int:
    """Target steps that verified no draft: llama.cpp logs only rounds with a draft, and a completion's tokens are
    its first (from the prefill) plus each logged round's accepted drafts and bonus token plus one per such step."""
    return sum(max(0, len(r.completion.tokens) - 1 - sum(a + 1 for a, _ in r.rounds)) for r in runs)


def table(result: dict[str, Any], title: str = "in llama.cpp") -> str:
    """The rows of :func:`measure` as a table that fits 80 columns, then the best setting and the command that
    serves it (on one line)."""
    width = max([24] + [len(name) + 1 for name in result["methods"]])  # labelled rows: "… [bf16]"
    lines = [f"{title} (llama.cpp {result['llama_cpp']}, {result['threads']} thread(s), {result['prompts']} prompts, "
             f"greedy, paired ×{result['repeats']})",
             f"{'method':<{width}} {'tok/s':>7} {'speedup':>8} {'90% interval':>14} {'tau':>5} {'same':>5}"]
    for name, r in result["methods"].items():
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else "1.00x"
        iv = f"[{r['interval'][0]:.2f}-{r['interval'][1]:.2f}]" if "interval" in r else ""
        tau = f"{r['tau']:.2f}" if "tau" in r else ""
        flag = "*" if r.get("first_sight_only") else ""
        lines.append(f"{name + flag:<{width}} {r['tokens_per_s']:>7.1f} {sp:>8} {iv:>14} {tau:>5} "
                     f"{r['identical_to_target']:>2}/{result['prompts']:<2}")
    if any(r.get("first_sight_only") for r in result["methods"].values()):
        lines.append("* first sight of each prompt only (its state outlives a request)")
    lines.append("tau counts the bonus token; same = outputs identical to llama.cpp's target alone")
    if result.get("best"):
        lines += [*wrapped(describe_best(result["best"])), "serve it (one line, to copy):", result["best"]["command"]]
    return "\n".join(lines)
