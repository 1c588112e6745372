"""EAGLE-1 in the original EAGLE layout: checked, and not exported, because the semantics differ.

The original EAGLE-1 draft model (SafeAILab/EAGLE ``eagle/model/cnets1.py`` / ``cnets.py``, the
layout vLLM's ``EAGLEModel`` / ``llama_eagle.py`` and SGLang's ``llama_eagle.py`` load) and
draftsmith's ``Eagle1Head`` agree on the skeleton — ``fc`` over concat(embedding, feature)
(2H → H, embedding first), one Llama decoder layer, the target's lm_head — and differ in three
places, any one of which changes every draft:

1. **the feature**: EAGLE-1 reads (and predicts) the target's *post-norm* last hidden state
   (``base_model.model(...)[0]``, after the final RMSNorm); draftsmith's head reads and predicts
   the *pre-norm* output of the last decoder layer. The final norm divides each row by its own
   RMS, which no linear map folds into ``fc``, and the predicted feature is fed back as the next
   input, so the two heads see different inputs from the second step on;
2. **the first layer's input norm**: EAGLE-1's layer 0 has no ``input_layernorm`` (cnets:
   ``if self.index != 0: self.input_layernorm = …``; vLLM/SGLang replace it by identity),
   draftsmith's uses transformers' ``LlamaDecoderLayer`` with its ``input_layernorm`` in place
   (RMSNorm of the fc output, scale vector trained); an RMSNorm is not the identity, and dropping
   it changes the attention and MLP inputs;
3. **the readout**: EAGLE-1 computes logits as ``lm_head(h)`` (its features are already normed);
   draftsmith computes ``lm_head(norm(h))`` with the target's final norm.

vLLM's loader (``vllm/model_executor/models/llama_eagle.py`` at commit 00da9231) adds a fourth:
its ``fc`` has no bias (``bias=False``) and ``load_weights`` skips names the model lacks, so
draftsmith's ``fc.bias`` (EAGLE-1's reference default, kept here) would be dropped silently.

Exporting the weights under EAGLE-1 names would load without an error and propose other
tokens than draftsmith's decoder — the silent failure exports must not have — so ``--to
eagle1`` is refused with this explanation. Making the head match means training it the EAGLE-1
way (post-norm features, no first input norm, lm_head readout): a change to ``drafters/eagle1.py``
and its recipe, not to export.
"""

from __future__ import annotations

from ..errors import DraftsmithError

DIFFERENCES = (
    "the feature (EAGLE-1: the target's post-norm last hidden state; draftsmith: the pre-norm output of the last "
    "layer, which no fc weight can turn into the other)",
    "layer 0's input_layernorm (absent in EAGLE-1, vLLM and SGLang; an RMSNorm with a trained scale in draftsmith)",
    "the readout (EAGLE-1: lm_head(h); draftsmith: lm_head(final_norm(h)))",
    "and for vLLM the fc bias (vLLM's EAGLE-1 fc has none and drops fc.bias silently)",
)


def refuse() -> None:
    raise DraftsmithError("an eagle1 head cannot be exported in the original EAGLE-1 layout: its semantics differ in "
                          + "; ".join(f"({i + 1}) {d}" for i, d in enumerate(DIFFERENCES))
                          + ". Loaded by an engine it would propose other tokens than in draftsmith's decoder. "
                            "See export/eagle1.py")
