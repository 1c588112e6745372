"""Export: every format is written, loaded back and proven (tiny random target, fp32), the
layer-id convention, the name tables, export from a ZeRO-3 checkpoint, and bad input refused
with one line and no folder left behind."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from draftsmith import drafters
from draftsmith.cli import main
from draftsmith.drafters import DraftLMConfig, Eagle1Config, Eagle3Config, MedusaConfig
from draftsmith.errors import DraftsmithError
from draftsmith.export import FORMATS, check, export
from draftsmith.export.adapters import adapter
from draftsmith.export.conventions import check_draft_vocab, engine_layer_ids, native_layer_ids
from draftsmith.target import default_eagle3_layers, load_target

pytestmark = pytest.mark.usefixtures("one_thread")

EAGLE3_LAYERS = [0, 1, 3]
"""Three distinct layers of the 4-layer tiny target (its default would name layer 0 twice)."""


def perturb(module: torch.nn.Module, seed: int = 1) -> None:
    """Move every trainable tensor off its init (norm scales off 1, LoRA B off 0) so that a swapped or
    dropped tensor changes the proposals."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(tiny_target_dir, "float32", "cpu")


@pytest.fixture(scope="module")
def vocab(target):
    """A 1,000-token draft vocabulary of scattered target ids (d2t offsets, t2d mask)."""
    ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(0))[:1000].sort().values
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(1000), t2d


@pytest.fixture(scope="module")
def sources(tmp_path_factory, target, vocab):
    """Saved drafter folders of every family, weights moved off their init."""
    root = tmp_path_factory.mktemp("drafters")
    configs = {"eagle3": Eagle3Config(feature_layers=EAGLE3_LAYERS), "medusa": MedusaConfig(num_heads=3, num_layers=2),
               "draft_lm": DraftLMConfig(num_layers=2, lora_rank=4), "eagle1": Eagle1Config()}
    out = {}
    for family, config in configs.items():
        module = config.build_module(target, vocab) if family == "eagle3" else config.build_module(target)
        perturb(module)
        out[family] = str(root / family)
        drafters.save(out[family], config, module, target)
    return out


# ---------------------------------------------------------------- conventions and name tables


def test_layer_ids_for_30_and_32_layer_targets():
    assert engine_layer_ids([1, 14, 26], 30, "vllm") == [2, 15, 27]  # SmolLM2
    assert engine_layer_ids([1, 14, 26], 30, "speculators") == [2, 15, 27]
    assert engine_layer_ids([1, 14, 26], 30, "sglang") == [1, 14, 26]  # SGLang adds 1 itself
    assert engine_layer_ids([1, 15, 28], 32, "vllm") == [2, 16, 29]  # Llama-3.1-8B
    for n in (30, 32):  # our defaults are the engines' defaults: capture before layers 2, N//2, N-3
        assert engine_layer_ids(default_eagle3_layers(n), n, "vllm") == [2, n // 2, n - 3]
        assert native_layer_ids([2, n // 2, n - 3], n, "vllm") == list(default_eagle3_layers(n))
    with pytest.raises(DraftsmithError, match="not a layer"):
        engine_layer_ids([30], 30, "vllm")
    with pytest.raises(DraftsmithError, match="names no decoder output"):
        native_layer_ids([0], 30, "vllm")  # the embedding: no decoder layer's output


def test_draft_vocab_checks_refuse_what_an_engine_would_misread(vocab, target):
    d2t, t2d = vocab
    check_draft_vocab(d2t, t2d, target.vocab_size, "x")
    with pytest.raises(DraftsmithError, match="int64"):
        check_draft_vocab(d2t.int(), t2d, target.vocab_size, "x")
    bad = d2t.clone()
    bad[-1] = target.vocab_size  # past the end
    with pytest.raises(DraftsmithError, match="outside"):
        check_draft_vocab(bad, t2d, target.vocab_size, "x")
    other = t2d.clone()
    other[int((~t2d).nonzero()[0])] = True
    with pytest.raises(DraftsmithError, match="t2d does not mark"):
        check_draft_vocab(d2t, other, target.vocab_size, "x")


@pytest.mark.parametrize("family, fmt", [("eagle3", "eagle3"), ("eagle3", "speculators"), ("medusa", "medusa"),
                                         ("medusa", "medusa-vllm"), ("medusa", "medusa2"), ("draft_lm", "hf")])
def test_state_dict_adapters_round_trip(target, vocab, family, fmt):
    config = {"eagle3": Eagle3Config(feature_layers=EAGLE3_LAYERS, num_layers=3), "medusa": MedusaConfig(num_heads=3, num_layers=2),
              "draft_lm": DraftLMConfig(num_layers=2)}[family]
    module = config.build_module(target, vocab) if family == "eagle3" else config.build_module(target)
    state = module.state_dict()
    table = adapter(family, fmt, num_layers=2)
    engine = table.to_engine(state)
    back = table.from_engine(engine)
    kept = {k for k in state if not k.startswith(table.skip)}
    assert set(back) == kept and all(back[k] is state[k] for k in kept)
    if fmt == "medusa-vllm":
        assert {"blocks.2.layers.1.bias", "lm_heads.2.weight"} <= set(engine) and "heads.0.2.weight" in back
    if fmt == "medusa":
        assert {"0.1.linear.weight", "2.2.weight"} <= set(engine)
    if fmt == "medusa2":
        assert {"medusa_head.0.1.linear.weight", "medusa_head.2.2.weight"} <= set(engine)
    if fmt == "speculators":  # speculators counts the layers from the first: draftsmith's next_layers.i is its layers.i+1
        assert "layers.0.hidden_norm.weight" in engine and "embed_tokens.weight" in engine
        assert {"layers.1.input_layernorm.weight", "layers.2.self_attn.q_proj.weight"} <= set(engine)
        assert engine["layers.2.self_attn.q_proj.weight"] is state["next_layers.1.self_attn.q_proj.weight"]
    if fmt == "eagle3":  # SGLang's additional_layers.i, whose pre-attention norm is hidden_norm; vLLM's layers.i read too
        assert "midlayer.hidden_norm.weight" in engine and "embed_tokens.weight" not in engine
        assert engine["additional_layers.1.hidden_norm.weight"] is state["next_layers.1.input_layernorm.weight"]
        assert not any(k.startswith("layers.") or ".input_layernorm" in k and "midlayer" not in k for k in engine)
        assert table.from_engine({"layers.2.mlp.up_proj.weight": state["fc.weight"]}) == {
            "next_layers.1.mlp.up_proj.weight": state["fc.weight"]}
    if fmt != "hf":  # a plain transformers model keeps its own names: that table is the identity
        with pytest.raises(DraftsmithError, match="no rule"):
            table.from_engine({"model.unknown.weight": torch.zeros(1)})


# ---------------------------------------------------------------- every format: export → check


@pytest.mark.parametrize("fmt", ["eagle3", "speculators", "medusa", "medusa-vllm", "hf"])
def test_export_then_check_proves_every_format(tmp_path, sources, target, fmt, capsys):
    out = str(tmp_path / fmt)
    assert main(["export", sources[FORMATS[fmt].families[0]], "--to", fmt, "--out", out]) == 0
    info = json.load(open(os.path.join(out, "draftsmith_export.json")))
    assert info["target"]["fingerprint"] == target.fingerprint and info["source"]["path"] == sources[FORMATS[fmt].families[0]]
    assert info["draftsmith_version"] and info["to"] == fmt
    capsys.readouterr()
    assert main(["export", "--check", out]) == 0
    lines = [line[len("ok  "):] for line in capsys.readouterr().out.splitlines() if line.startswith("ok  ")]
    assert any("proposes the source drafter's 4 tokens on 2 prompts, greedy and sampled" in line for line in lines)
    assert any("accepts the same drafts in every round" in line for line in lines)
    if fmt in ("eagle3", "speculators"):
        cfg = json.load(open(os.path.join(out, "config.json")))
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
            assert cfg[flag] is False
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # vLLM: ours + 1
        assert cfg["draft_vocab_size"] == 1000 and cfg["target_hidden_size"] == 64
        assert any("d2t: 1000 int64 offsets" in line for line in lines)
    if fmt == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == EAGLE3_LAYERS  # SGLang adds 1
    if fmt == "speculators":
        assert cfg["architectures"] == ["Eagle3DraftModel"]  # what speculators' own save_pretrained writes
        assert any("speculators' forward on the same hidden states" in line for line in lines)
        assert any("loads all 16 tensors" in line for line in lines)
    if fmt == "medusa-vllm":
        cfg = json.load(open(os.path.join(out, "config.json")))
        assert [k for k in cfg if "num" in k] == ["num_heads", "num_hidden_layers"] and cfg["medusa_fc_bias"] is True
    if fmt == "hf":
        assert any("assisted generation" in line for line in lines)


def _tamper_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


def _tamper_tensors(folder: str, file: str, fn) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, file)
    save_file(fn(load_file(path)), path)


def test_check_catches_what_would_make_an_engine_accept_nothing(tmp_path, sources):
    base = str(tmp_path / "good")
    export(sources["eagle3"], "eagle3", base)

    def fresh(name: str) -> str:
        path = str(tmp_path / name)
        shutil.copytree(base, path)
        return path

    shifted = fresh("ids")  # the classic off-by-one, written consistently for both engines
    _tamper_config(shifted, eagle_aux_hidden_state_layer_ids=[2, 3, 4],
                   eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True})
    with pytest.raises(DraftsmithError, match="proposes"):
        check(shifted)
    flag = fresh("flag")
    _tamper_config(flag, norm_before_residual=None)
    with pytest.raises(DraftsmithError, match="norm_before_residual"):
        check(flag)
    renamed = fresh("renamed")  # a name the engine would drop silently
    _tamper_tensors(renamed, "model.safetensors",
                    lambda t: {("midlayer.hiddennorm.weight" if k == "midlayer.hidden_norm.weight" else k): v for k, v in t.items()})
    with pytest.raises(DraftsmithError, match="missing.*hidden_norm"):
        check(renamed)
    swapped = fresh("swapped")  # right names, wrong tensors: only loading back sees it
    _tamper_tensors(swapped, "model.safetensors", lambda t: {**t, "midlayer.hidden_norm.weight": t["midlayer.input_layernorm.weight"],
                                                             "midlayer.input_layernorm.weight": t["midlayer.hidden_norm.weight"]})
    with pytest.raises(DraftsmithError, match="proposes|distributions differ"):
        check(swapped)
    d2t = fresh("d2t")
    _tamper_tensors(d2t, "model.safetensors", lambda t: {**t, "d2t": t["d2t"].int()})
    with pytest.raises(DraftsmithError, match="d2t"):
        check(d2t)


def test_speculators_check_refuses_a_missing_embedding(tmp_path, sources):
    out = str(tmp_path / "spec")
    export(sources["eagle3"], "speculators", out)
    _tamper_tensors(out, "model.safetensors", lambda t: {k: v for k, v in t.items() if k != "embed_tokens.weight"})
    with pytest.raises(DraftsmithError, match="embed_tokens"):
        check(out)


@pytest.mark.parametrize("fmt", ["speculators", "eagle3"])
def test_a_bf16_trained_head_passes_its_check(tmp_path, tiny_target_dir, target, fmt):
    """A head trained with a bf16 target: speculators stores the embedding in bf16, as the head was trained on it
    and as vLLM serves it; the check rounds the fp32 source's copy the same way (it failed by |Δq| 7.7e-03)."""
    from safetensors.torch import load_file

    bf16_target = load_target(tiny_target_dir, "bfloat16", "cpu")
    config = Eagle3Config(feature_layers=EAGLE3_LAYERS)
    module = config.build_module(bf16_target)
    perturb(module)
    source, out = str(tmp_path / "bf16-head"), str(tmp_path / fmt)
    drafters.save(source, config, module, bf16_target)
    export(source, fmt, out)
    stored = load_file(os.path.join(out, "model.safetensors"))
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.bfloat16}
    if fmt == "speculators":
        assert torch.equal(stored["embed_tokens.weight"], target.model.get_input_embeddings().weight.bfloat16())
    lines = check(out)
    assert any("proposes the source drafter's 4 tokens" in line for line in lines)


def test_speculators_logit_tolerance_is_relative_to_the_logits(sources, target, monkeypatch):
    """A wide-logit target (Gemma-3: logits ~200) differs by more than 1e-4 in fp32 with the same top tokens."""
    from draftsmith.drafters.common import shift_left
    from draftsmith.export import eagle3 as eagle3_export
    from draftsmith.export.run import compare_speculators, default_prompts
    from draftsmith.export.source import open_source

    drafter = open_source(sources["eagle3"]).drafter
    with torch.no_grad():
        drafter.module.lm_head.weight.mul_(400.0 / float(drafter.module.lm_head.weight.abs().max()))  # logits ~ 10²
    ids = default_prompts(target)[0]
    x = torch.tensor([ids])
    features = target.forward(x, feature_layers=tuple(drafter.feature_layers)).features
    with torch.no_grad():
        ours = [logits for _, logits in drafter.module.unroll(x, features, steps=3)]
    scale = max(float(o.abs().max()) for o in ours)
    assert scale > 50

    def speculators(relative):
        def run(folder, input_ids, feats, steps):
            assert torch.equal(input_ids, shift_left(x, 1))
            return [o * (1 + relative) for o in ours], []
        return run

    monkeypatch.setattr(eagle3_export, "speculators_logits", speculators(2e-6))  # Δ > 1e-4 absolute, 2e-6 relative
    line = compare_speculators("unused", target, drafter, ids)[-1]
    assert "of the largest |logit|" in line
    monkeypatch.setattr(eagle3_export, "speculators_logits", speculators(5e-5))
    with pytest.raises(DraftsmithError, match=r"differ from draftsmith's head by .* \(> 1e-05 × the largest \|logit\|"):
        compare_speculators("unused", target, drafter, ids)


def test_a_failing_check_prints_the_checks_that_passed_before_it(tmp_path, sources, capsys):
    out = str(tmp_path / "swapped")
    export(sources["eagle3"], "eagle3", out)
    _tamper_tensors(out, "model.safetensors", lambda t: {**t, "midlayer.hidden_norm.weight": t["midlayer.input_layernorm.weight"],
                                                         "midlayer.input_layernorm.weight": t["midlayer.hidden_norm.weight"]})
    capsys.readouterr()
    assert main(["export", "--check", out]) == 2
    captured = capsys.readouterr()
    passed = [line for line in captured.out.splitlines() if line.startswith("ok  ")]
    assert any("tensors: every name, shape and dtype the loader reads" in line for line in passed)  # static checks passed
    assert captured.out.splitlines()[-1] == f"FAILED after {len(passed)} passed check(s)"
    assert "draftsmith: error: the export" in captured.err and "Traceback" not in captured.err
    # a static check that fails part-way: the static checks before it are listed too
    _tamper_config(out, norm_before_residual=None)
    assert main(["export", "--check", out]) == 2
    captured = capsys.readouterr()
    assert "ok  architectures = ['LlamaForCausalLMEagle3']" in captured.out.splitlines()
    assert "norm_before_residual = false" in captured.err
    assert captured.out.splitlines()[-1] == "FAILED after 7 passed check(s)"  # the header and 6 static checks


@pytest.mark.parametrize("norms", [{"fc_norm": True, "norm_output": True}, {"norm_before_fc": True}])
def test_eagle31_options_are_exported_true_and_proven_by_speculators(tmp_path, target, vocab, norms):
    """The flags a head uses are written true, their norms stored, loaded back into the same head, and
    speculators' own forward (which reads the flags) equals draftsmith's; the original layout refuses them."""
    from safetensors.torch import load_file

    config = Eagle3Config(feature_layers=EAGLE3_LAYERS, **norms)
    module = config.build_module(target, vocab)
    perturb(module)  # the norm scales too: a dropped norm changes the proposals
    source, out = str(tmp_path / "head"), str(tmp_path / "spec")
    drafters.save(source, config, module, target)
    export(source, "speculators", out)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert {flag: cfg[flag] for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")} == {
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False, **norms}
    stored = load_file(os.path.join(out, "model.safetensors"))
    norm_tensors = {k for k in stored if k.startswith(("fc_norm.", "input_norm."))}
    assert norm_tensors == ({"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} if "fc_norm" in norms
                            else {"input_norm.weight"})
    lines = check(out)
    assert any("speculators' forward on the same hidden states" in line for line in lines)
    assert any(f"loads all {16 + len(norm_tensors)} tensors" in line for line in lines)
    assert any("proposes the source drafter's 4 tokens" in line for line in lines)
    with pytest.raises(DraftsmithError, match=r"uses .*EAGLE-3.1.*export it with --to speculators"):
        export(source, "eagle3", str(tmp_path / "eagle3"))
    assert not os.path.exists(tmp_path / "eagle3")


def test_eagle1_is_refused_naming_where_the_semantics_differ(tmp_path, sources, capsys):
    out = tmp_path / "e1"
    assert main(["export", sources["eagle1"], "--to", "eagle1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "post-norm" in err and "input_layernorm" in err and "lm_head(final_norm(h))" in err
    assert not out.exists()


# ---------------------------------------------------------------- bad input: one line, no folder


def _refused(args: list[str], out, capsys, match: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("draftsmith: error:") and "\n" not in err and match in err, err
    assert not os.path.exists(out) or os.listdir(out) == ["keep"]


def test_bad_input_is_one_line_and_leaves_no_folder(tmp_path, sources, capsys, smollm2_tokenizer):
    from .conftest import tiny_llama

    out = tmp_path / "out"
    _refused(["export", sources["medusa"], "--to", "eagle3", "--out", str(out)], out, capsys, "medusa-vllm")
    _refused(["export", sources["eagle3"], "--to", "hf", "--out", str(out)], out, capsys, "--to eagle3 or --to speculators")
    _refused(["export", sources["eagle1"], "--to", "eagle3", "--out", str(out)], out, capsys, "--to eagle1 says why")
    _refused(["export", sources["eagle3"], "--to", "onnx", "--out", str(out)], out, capsys, "unknown export format")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("hi")
    _refused(["export", str(foreign), "--to", "eagle3", "--out", str(out)], out, capsys, "neither a drafter folder")
    incomplete = tmp_path / "step_00000003"
    incomplete.mkdir()
    (incomplete / "trainer_state.json").write_text(json.dumps({"step": 3}))
    _refused(["export", str(incomplete), "--to", "eagle3", "--out", str(out)], out, capsys, "does not record the drafter")
    (incomplete / "trainer_state.json").write_text(json.dumps({"step": 3, "zero_stage": 3, "identity": {
        "drafter": {"type": "eagle3"}, "target": "x"}}))
    _refused(["export", str(incomplete), "--to", "eagle3", "--out", str(out)], out, capsys, "has no checksums.json")
    other = tmp_path / "other_target"
    tiny_llama(layers=4, seed=7).save_pretrained(other)
    smollm2_tokenizer.save_pretrained(other)
    _refused(["export", sources["eagle3"], "--to", "eagle3", "--out", str(out), "--target", str(other)], out, capsys,
             "was made for a target with fingerprint")
    out.mkdir()
    (out / "keep").write_text("mine")
    _refused(["export", sources["eagle3"], "--to", "eagle3", "--out", str(out)], out, capsys, "--force")
    assert main(["export", sources["eagle3"], "--to", "eagle3", "--out", str(out), "--force"]) == 0
    assert "keep" not in os.listdir(out) and "model.safetensors" in os.listdir(out)


def test_a_full_disk_or_a_read_only_folder_during_export_is_one_line_and_keeps_the_earlier_export(
        tmp_path, sources, capsys, monkeypatch):
    """The weights half written when the disk fills, or no temporary folder allowed at all: one line naming --out;
    no temporary folder is left, and the export --force was to replace is still whole."""
    import errno

    import safetensors.torch

    from draftsmith import files

    out = tmp_path / "out"
    args = ["export", sources["eagle3"], "--to", "eagle3", "--out", str(out), "--force"]
    assert main(args) == 0
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    capsys.readouterr()

    def full(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", full)
        _refused(args, tmp_path / "unused", capsys, f"no space left on {out}")

    def read_only(directory, path, make):
        raise OSError(errno.EROFS, "Read-only file system", directory)

    with monkeypatch.context() as m:
        m.setattr(files, "_create_unique", read_only)
        _refused(args, tmp_path / "unused", capsys, "is on a read-only file system")
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary folder beside it
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


def test_an_out_that_is_holds_or_lies_inside_the_source_is_refused_even_with_force(tmp_path, sources, capsys):
    """--force replaces --out as a whole: on the source itself, a folder above it (here through a
    link) or one inside it, that would delete the drafter being exported."""
    source = tmp_path / "run" / "drafter"
    shutil.copytree(sources["eagle3"], source)
    files = sorted(os.listdir(source))
    os.symlink(tmp_path / "run", tmp_path / "link")
    for out, where in ((source, "is the source folder"), (tmp_path / "link", "holds the source folder"),
                       (tmp_path, "holds the source folder"), (source / "export", "lies inside the source folder")):
        assert main(["export", str(source), "--to", "eagle3", "--out", str(out), "--force"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"draftsmith: error: --out '{out}' {where} '{source}': the export replaces --out as a whole and "
                       f"would destroy its own source; choose a folder outside it")
        assert sorted(os.listdir(source)) == files
    assert main(["export", str(source), "--to", "eagle3", "--out", str(tmp_path / "run" / "eagle3"), "--force"]) == 0


def test_an_out_that_is_or_holds_the_current_folder_is_refused(tmp_path, sources, capsys, monkeypatch):
    """`export --out . --force` raised EBUSY with a traceback (and a path spelled otherwise would have replaced the
    shell's folder); `--to gguf-target` too."""
    (tmp_path / "work" / "sub").mkdir(parents=True)
    (tmp_path / "work" / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path / "work" / "sub")
    for out, where in ((".", "is"), (str(tmp_path / "work"), "holds"), ("..", "holds")):
        for to in ("eagle3", "gguf-target"):
            args = [sources["eagle3"], "--to", to] if to != "gguf-target" else ["--to", to, "--target", "x"]
            assert main(["export", *args, "--out", out, "--force"]) == 2
            err = capsys.readouterr().err.strip()
            assert err == f"draftsmith: error: --out '{out}' {where} the current folder: the export replaces --out as " \
                          f"a whole; choose a new folder (e.g. --out ./export)", (to, out)
    assert (tmp_path / "work" / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------- straight from a ZeRO-3 checkpoint


@pytest.mark.parametrize("engine", ["zero3", "zero0", "bf16-zero2"])
def test_export_from_a_checkpoint_equals_export_from_the_saved_drafter(tmp_path, tiny_target_dir, tiny_train_data,
                                                                       engine):
    """Straight from a checkpoint folder, with no engine or launcher: ZeRO-3 partitions are gathered, ZeRO-0's whole
    module is read, and a bf16 engine's fp32 master weights round to the bf16 drafter it saved."""
    from safetensors.torch import load_file

    from draftsmith.config import load_recipe
    from draftsmith.train.run import run_training

    run = tmp_path / "run"
    extra = [f"train.deepspeed={engine}", "target.dtype=float32"]
    if engine == "bf16-zero2":
        ds = tmp_path / "bf16_zero2.json"
        ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
        extra = [f"train.deepspeed={ds}", "target.dtype=bfloat16"]
    recipe = load_recipe(None, [
        f"target.name={tiny_target_dir}", "drafter.type=eagle3", f"drafter.feature_layers={EAGLE3_LAYERS}",
        f"train.dataset={tiny_train_data}", "train.batch_size=4", "train.max_length=48", "train.eval.heldout=8",
        "train.steps=2", "train.ttt_steps=2", "train.optimizer.lr=0.003", "train.logging.wandb=disabled",
        "train.logging.progress=false", "train.eval.decoder_at_end=false", f"run_dir={run}", *extra])
    summary = run_training(recipe)
    ckpt = run / "checkpoints" / "step_00000002"
    if engine == "zero3":
        states = torch.load(ckpt / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=True)
        assert states["module"]["drafter.fc.weight"].numel() == 0  # partitioned: the module file holds no weights
    export(str(ckpt), "eagle3", str(tmp_path / "from_ckpt"))
    export(summary["drafter"], "eagle3", str(tmp_path / "from_drafter"))
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("from_ckpt", "from_drafter"))
    assert set(a) == set(b)
    for k in a:  # fp32 checkpoints: bit-identical; bf16: the engine's bf16 weights are its fp32 masters rounded
        assert torch.equal(a[k].to(b[k].dtype), b[k]), k
    fresh = Eagle3Config(feature_layers=EAGLE3_LAYERS).build_module(load_target(tiny_target_dir, "float32", "cpu"))
    assert not torch.equal(a["fc.weight"].float(), fresh.fc.weight)  # trained weights, not the init
    if engine == "zero3":
        cfg = [json.load(open(tmp_path / d / "config.json")) for d in ("from_ckpt", "from_drafter")]
        assert cfg[0] == cfg[1]
        assert any("proposes the source drafter's" in line for line in check(str(tmp_path / "from_ckpt")))


@pytest.mark.parametrize("residual", [True, False])
def test_a_multi_layer_head_is_exported_only_where_its_layer_stack_is_computed(tmp_path, target, vocab, residual):
    """A two-layer head whose second layer reads the first's whole output (speculators', vLLM's) is exported --to
    speculators and proven there by speculators' own class (two layers, every tensor loaded, equal logits); one whose
    second layer reads the first's MLP output alone (SGLang's) --to eagle3 as SGLang's additional_layers, loaded back
    into the same head. Each is refused, in one line, by the format whose engines compute the other stack, and both
    by llama.cpp (one decoder layer)."""
    from safetensors.torch import load_file

    config = Eagle3Config(feature_layers=EAGLE3_LAYERS, num_layers=2, residual_between_layers=residual)
    module = config.build_module(target, vocab)
    perturb(module)
    source = str(tmp_path / "deep")
    drafters.save(source, config, module, target)
    fmt, other = ("speculators", "eagle3") if residual else ("eagle3", "speculators")
    export(source, fmt, str(tmp_path / fmt))
    cfg = json.load(open(tmp_path / fmt / "config.json"))
    assert (cfg["transformer_layer_config"] if residual else cfg)["num_hidden_layers"] == 2
    stored = set(load_file(str(tmp_path / fmt / "model.safetensors")))
    lines = check(str(tmp_path / fmt))
    assert "2 Llama decoder layers" in lines and any("proposes the source drafter's 4 tokens" in line for line in lines)
    if residual:
        assert {"layers.1.input_layernorm.weight", "layers.1.self_attn.q_proj.weight"} <= stored
        assert any("speculators Eagle3DraftModel loads all 25 tensors" in line for line in lines)
        assert any("speculators' forward on the same hidden states" in line for line in lines)
    else:
        assert {"additional_layers.0.hidden_norm.weight", "additional_layers.0.self_attn.q_proj.weight"} <= stored
        assert not any(k.startswith("additional_layers.0.input_layernorm") for k in stored)
    why = "SGLang .* drops the residual stream" if residual else "speculators' Eagle3DraftModel and vLLM compute"
    for to, match in ((other, why), ("gguf", r"llama.cpp's eagle3 graph has one decoder layer")):
        with pytest.raises(DraftsmithError, match=f"this head has 2 decoder layers, and {match}") as e:
            export(source, to, str(tmp_path / to))
        assert "\n" not in str(e.value) and not os.path.exists(tmp_path / to / "model.safetensors")
