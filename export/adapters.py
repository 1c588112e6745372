"""State-dict adapters: one name table per (drafter family, engine format), both directions.

As in torchtitan's ``state_dict_adapter.py``: the model files keep their own names, and each
table maps a native draftsmith name to the name the engine's loader reads (``to_engine``) and
back (``from_engine``). A name no rule covers is an error in both directions — an engine that
meets an unknown name usually drops it silently (vLLM's Medusa and SGLang's EAGLE-3 loaders
skip names they do not know), which is exactly the "trains well, accepts nothing" failure.

A rule is a pair of templates; ``{h}``/``{l}`` match one dotted component (a digit run),
``{p}`` the rest of the name, and any other ``{X}`` is a constant taken from the adapter's
``constants`` (Medusa's final projection index is the head's block count). ``{l+1}`` is the
index ``l`` one higher on that side (speculators counts an EAGLE-3 head's layers from its
first, ``layers.0``, draftsmith its layers after the first, ``next_layers.0`` = ``layers.1``). Native names that
are frozen copies of the target (``skip``) are left out of the export: the engine takes them
from the target model it serves (EAGLE-3's embedding in SGLang/vLLM), unless the format
needs them (speculators).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import Tensor

from ..errors import DraftsmithError

_FIELD = re.compile(r"\{(\w+)(?:\+(\d+))?\}")


@dataclass(frozen=True)
class Rule:
    native: str
    engine: str


def _compile(template: str, constants: dict[str, str]) -> re.Pattern:
    out, pos = "", 0
    for m in _FIELD.finditer(template):
        out += re.escape(template[pos : m.start()])
        name = m.group(1)
        if name in constants:
            out += re.escape(constants[name])
        elif name == "p":
            out += r"(?P<p>.+)"
        else:
            out += rf"(?P<{name}>\d+)"
        pos = m.end()
    return re.compile(out + re.escape(template[pos:]) + r"\Z")


def _offsets(template: str) -> dict[str, int]:
    """The index fields of ``template`` written ``{l+K}``: name → K."""
    return {m.group(1): int(m.group(2)) for m in _FIELD.finditer(template) if m.group(2)}


def _fill(template: str, values: dict[str, str]) -> str:
    return _FIELD.sub(lambda m: str(int(values[m.group(1)]) + int(m.group(2))) if m.group(2) else values[m.group(1)],
                      template)


@dataclass
class StateDictAdapter:
    """Native draftsmith names ↔ one engine format's names, for one drafter family."""

    family: str
    format: str
    rules: list[Rule]
    skip: tuple[str, ...] = ()
    """Native prefixes not exported (frozen target parts the engine brings itself)."""
    constants: dict[str, int] = field(default_factory=dict)

    def _map(self, name: str, forward: bool) -> str:
        consts = {k: str(v) for k, v in self.constants.items()}
        for rule in self.rules:
            src, dst = (rule.native, rule.engine) if forward else (rule.engine, rule.native)
            m = _compile(src, consts).match(name)
            if m:
                found = dict(m.groupdict())
                shifted = {k: int(found[k]) - shift for k, shift in _offsets(src).items()}  # as the other side counts
                if any(v < 0 for v in shifted.values()):
                    continue
                return _fill(dst, {**consts, **found, **{k: str(v) for k, v in shifted.items()}})
        side = "draftsmith" if forward else self.format
        raise DraftsmithError(f"the {self.family} → {self.format} name table has no rule for the {side} tensor '{name}'")

    def to_engine(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Native state dict → the engine's names (skipped target parts left out)."""
        return {self._map(k, True): v for k, v in state.items() if not k.startswith(self.skip)}

    def from_engine(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The engine's names → native names."""
        return {self._map(k, False): v for k, v in state.items()}


# vLLM: vllm/model_executor/models/llama_eagle3.py (LlamaModel.load_weights renames midlayer. →
# layers.0., Eagle3LlamaForCausalLM.load_weights renames d2t → draft_id_to_target_id and skips t2d);
# SGLang: python/sglang/srt/models/llama_eagle3.py (model.midlayer, model.fc, model.norm, lm_head,
# hot_token_id = d2t + arange). Both take the embedding from the target when the file has none.
# input_norm (norm_before_fc) is for llama.cpp's converter, which reads this layout too (conversion/llama.py: input_norm
# → enc.output_norm); the engines above have no such tensor, and export/eagle3.py refuses such a head --to eagle3.
# The layers after the first (a multi-layer head): SGLang (same file at 03d5a777) builds them as additional_layers.{j}
# (BasicDecoderLayer: its pre-attention norm is hidden_norm, it has no input_layernorm), which vLLM does not know (its
# loader raises on the name); vLLM's own name for them is layers.{i} (i ≥ 1), which SGLang skips silently. draftsmith
# writes SGLang's (export/eagle3.py: a head that computes what SGLang computes) and reads both.
EAGLE3 = [Rule("fc.{p}", "fc.{p}"), Rule("input_norm.{p}", "input_norm.{p}"), Rule("midlayer.{p}", "midlayer.{p}"),
          Rule("midlayer.{p}", "layers.0.{p}"),  # read only (vLLM's name of the first layer; the rule above writes)
          Rule("next_layers.{l}.input_layernorm.{p}", "additional_layers.{l}.hidden_norm.{p}"),
          Rule("next_layers.{l}.{p}", "additional_layers.{l}.{p}"), Rule("next_layers.{l}.{p}", "layers.{l+1}.{p}"),
          Rule("norm.{p}", "norm.{p}"), Rule("lm_head.{p}", "lm_head.{p}"), Rule("d2t", "d2t"), Rule("t2d", "t2d")]
# speculators 0.9.0 Eagle3DraftModel: embed_tokens, fc, layers.0 (LlamaDecoderEagle3FirstLayer), layers.1… (transformers'
# LlamaDecoderLayer), norm, lm_head, d2t, t2d, and with the EAGLE-3.1 flags input_norm (norm_before_fc) and
# fc_norm.{0,1,2}; verifier_norm / verifier_lm_head are training-only and not stored.
SPECULATORS = [Rule("embed_tokens.{p}", "embed_tokens.{p}"), Rule("fc.{p}", "fc.{p}"),
               Rule("input_norm.{p}", "input_norm.{p}"), Rule("fc_norm.{l}.{p}", "fc_norm.{l}.{p}"),
               Rule("midlayer.{p}", "layers.0.{p}"), Rule("next_layers.{l}.{p}", "layers.{l+1}.{p}"),
               Rule("norm.{p}", "norm.{p}"), Rule("lm_head.{p}", "lm_head.{p}"), Rule("d2t", "d2t"), Rule("t2d", "t2d")]
# speculators 0.9.0 PEagleDraftModel: Eagle3DraftModel's names plus mask_hidden [1, 1, 3H] (the masked rows' features).
# Medusa reference (FasterDecoding/Medusa, TGI): medusa_lm_head.safetensors holds head h's residual
# block l as {h}.{l}.linear.* and its projection as {h}.{L}.weight (L = blocks per head).
MEDUSA = [Rule("heads.{h}.{l}.linear.{p}", "{h}.{l}.linear.{p}"), Rule("heads.{h}.{L}.weight", "{h}.{L}.weight")]
# vLLM vllm/model_executor/models/medusa.py: blocks.{h}.layers.{l}.{weight,bias} (bias iff
# medusa_fc_bias), lm_heads.{h}.weight; names it does not know are dropped silently.
MEDUSA_VLLM = [Rule("heads.{h}.{l}.linear.{p}", "blocks.{h}.layers.{l}.{p}"), Rule("heads.{h}.{L}.weight", "lm_heads.{h}.weight")]
# Medusa-2 (FasterDecoding/Medusa medusa_model.py, ctlllll/axolotl monkeypatch/medusa_utils.py): the heads are the
# model's medusa_head module, saved with the backbone by save_pretrained: the reference layout's names (that module's
# state dict) under medusa_head.; the backbone's tensors are not the drafter's (export/medusa2.py keeps them apart).
MEDUSA2 = [Rule(rule.native, "medusa_head." + rule.engine) for rule in MEDUSA]
# DFlash: z-lab's DFlashDraftModel, speculators' DFlashDraftModel (its converter copies the z-lab body
# as is) and llama.cpp's converter read the same body names; the embedding and lm_head are the target's.
DFLASH = [Rule("fc.{p}", "fc.{p}"), Rule("hidden_norm.{p}", "hidden_norm.{p}"), Rule("layers.{l}.{p}", "layers.{l}.{p}"),
          Rule("norm.{p}", "norm.{p}")]
# speculators' DFlashDraftModel with a reduced draft vocabulary (DraftVocabMixin) also stores its lm_head rows,
# d2t and t2d; with the full vocabulary the lm_head is the target's and left out.
DFLASH_SPECULATORS = DFLASH + [Rule("lm_head.{p}", "lm_head.{p}"), Rule("d2t", "d2t"), Rule("t2d", "t2d")]
# speculators' DFlash2DraftModel: DFlash's body (its layers' attention_conv / mlp_conv ride under layers.{l}) plus the
# candidate_selector's codebooks and projection; full vocabulary only, so the lm_head is the target's and left out.
# llama.cpp's converter reads the same names in z-lab's layout (conversion/qwen.py DFlashModel, "DFlash2DraftModel").
DFLASH2_SPECULATORS = DFLASH + [Rule("candidate_selector.{p}", "candidate_selector.{p}")]
# llama.cpp's converter (DFlashModel) reads z-lab's names; with a reduced draft vocabulary the lm_head rows go in too
# (written as its ``output``) and export/gguf.py adds the d2t the converter does not write.
DFLASH_LLAMACPP = DFLASH + [Rule("lm_head.{p}", "lm_head.{p}")]
# transformers: a draft LM is exported as the plain causal LM it is (LoRA merged first).
HF = [Rule("{p}", "{p}")]


def adapter(family: str, fmt: str, num_layers: int = 1, reduced_vocab: bool = False) -> StateDictAdapter:
    """The adapter of (family, format); ``num_layers``: Medusa's residual blocks per head; ``reduced_vocab``: a
    DFlash drafter with a draft vocabulary, whose lm_head (its rows of the target's) the speculators format and
    llama.cpp's GGUF hold."""
    table = {
        ("eagle3", "eagle3"): lambda: StateDictAdapter(family, fmt, EAGLE3, skip=("embed_tokens.",)),
        ("eagle3", "speculators"): lambda: StateDictAdapter(family, fmt, SPECULATORS),
        ("peagle", "speculators"): lambda: StateDictAdapter(family, fmt, SPECULATORS + [Rule("mask_hidden", "mask_hidden")]),
        ("medusa", "medusa"): lambda: StateDictAdapter(family, fmt, MEDUSA, ("feature_norm.",), {"L": num_layers}),
        ("medusa", "medusa-vllm"): lambda: StateDictAdapter(family, fmt, MEDUSA_VLLM, ("feature_norm.",), {"L": num_layers}),
        ("medusa", "medusa2"): lambda: StateDictAdapter(family, fmt, MEDUSA2, ("feature_norm.",), {"L": num_layers}),
        ("draft_lm", "hf"): lambda: StateDictAdapter(family, fmt, HF),
        ("dflash", "dflash"): lambda: StateDictAdapter(family, fmt, DFLASH, skip=("embed_tokens.", "lm_head.")),
        ("dflash", "speculators-dflash"): lambda: StateDictAdapter(
            family, fmt, DFLASH_SPECULATORS, skip=("embed_tokens.",) if reduced_vocab else ("embed_tokens.", "lm_head.")),
        ("dflash2", "speculators-dflash"): lambda: StateDictAdapter(family, fmt, DFLASH2_SPECULATORS, skip=("embed_tokens.", "lm_head.")),
        ("dflash2", "gguf"): lambda: StateDictAdapter(family, fmt, DFLASH2_SPECULATORS, skip=("embed_tokens.", "lm_head.")),
        ("dflash", "gguf"): lambda: StateDictAdapter(
            family, fmt, DFLASH_LLAMACPP, skip=("embed_tokens.", "d2t", "t2d") if reduced_vocab else ("embed_tokens.", "lm_head.")),
    }
    if (family, fmt) not in table:
        raise DraftsmithError(f"no state-dict adapter for a {family} drafter in the {fmt} format")
    return table[(family, fmt)]()
