"""EAGLE-1 / EAGLE-3 heads: shapes and dtypes, parity with transformers, the runtime's cache
roll-back against a from-scratch reference, and (EAGLE-3) the training-time-test unroll."""

from __future__ import annotations

import copy

import pytest
import torch

from draftsmith.drafters.common import causal_mask, shift_left
from draftsmith.drafters.eagle1 import Eagle1Config
from draftsmith.eval.sampling import Warp
from draftsmith.target import Target

SAMPLE = Warp(temperature=1.0)


def features(target: Target, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """[len(tokens), F] target features of every position (one uncached forward)."""
    return target.forward(torch.tensor([tokens]), feature_layers=layers).features[0]


def drive(target: Target, drafter, prompt: list[int], accept: list[int], k: int, seed: int = 0):
    """Run the drafter protocol by hand, as the decoder does, accepting accept[i] drafts in round i.

    Yields (committed tokens, proposal) before each round's acceptance.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = list(prompt) + [11]
    drafter.reset()
    drafter.update(torch.tensor(tokens), features(target, prompt, drafter.feature_layers))
    for i, m in enumerate(accept):
        proposal = drafter.propose(k, SAMPLE, gen)
        yield list(tokens), proposal
        m = min(m, proposal.tokens.shape[0])
        new = proposal.tokens[:m].tolist() + [(97 * (i + 3)) % 5000]
        n = len(tokens)
        f = features(target, tokens + new[:-1], drafter.feature_layers)  # positions 0 … n+m-1
        drafter.update(torch.tensor(new), f[n - 1 : n + m])  # the verified positions n-1 … n+m-1
        tokens += new


def reference_probs(head, target, tokens: list[int], drafts: list[int], fuse) -> list[torch.Tensor]:
    """The draft distributions recomputed from scratch: no cache, true features for committed rows."""
    f = features(target, tokens[:-1], target_layers(head, target))  # f_0 … f_{n-2}
    rows = fuse(f)[None]  # [1, n-1, H]
    ids = tokens[1:]
    out = []
    for d in drafts:
        hidden, logits = head(torch.tensor([ids]), rows)
        out.append(SAMPLE.probs(head.target_logits(logits[0, -1])))
        rows = torch.cat([rows, hidden[:, -1:]], dim=1)  # the predicted feature feeds the next row
        ids = ids + [d]
    return out


def target_layers(head, target) -> tuple[int, ...]:
    return getattr(head, "feature_layer_ids", (target.num_layers - 1,))


# ---------------------------------------------------------------- EAGLE-1


@pytest.fixture(scope="module")
def eagle1(tiny_target):
    return Eagle1Config(seed=3).build(tiny_target)


def test_eagle1_shapes_dtypes_and_trainable_parts(tiny_target, smollm2_tokenizer):
    for dtype in (torch.float32, torch.bfloat16):
        target = Target(copy.deepcopy(tiny_target.model).to(dtype), smollm2_tokenizer, name="tiny", fingerprint="x")
        head = Eagle1Config().build_module(target)
        ids = torch.randint(0, 1000, (2, 5))
        f = torch.randn(2, 5, 64, dtype=dtype)
        hidden, logits = head(ids, f)
        assert hidden.shape == (2, 5, 64) and logits.shape == (2, 5, 49152)
        assert hidden.dtype == logits.dtype == dtype
        assert head.rotary_emb.inv_freq.dtype == torch.float32  # RoPE stays exact in bf16
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("fc.", "layers.0.")) for n in trainable)
    assert torch.equal(head.embed_tokens.weight, target.model.model.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, target.model.lm_head.weight)
    assert head.embed_tokens.weight.data_ptr() != target.model.model.embed_tokens.weight.data_ptr()  # a copy


def test_eagle1_layer_matches_transformers_llama_model(eagle1):
    """Our mask/RoPE/cache handling around LlamaDecoderLayer = transformers' own LlamaModel."""
    from transformers import LlamaModel

    head = eagle1.module
    hf = LlamaModel(head.layer_config).eval()
    hf.layers[0].load_state_dict(head.layers[0].state_dict())
    hf.norm.load_state_dict(head.norm.state_dict())
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 7))
    f = torch.randn(2, 7, 64)
    pad = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    with torch.no_grad():
        x = head.fc(torch.cat([head.embed_tokens(ids), f], -1))
        ref = hf(inputs_embeds=x, attention_mask=pad).last_hidden_state
        ours, _ = head(ids, f, attention_mask=pad)
        assert torch.allclose(head.norm(ours)[0], ref[0], atol=1e-5)
        assert torch.allclose(head.norm(ours)[1, :5], ref[1, :5], atol=1e-5)
        # incremental decoding through the cache = one full pass
        cache = head.new_cache()
        a, _ = head(ids[:1, :4], f[:1, :4], cache=cache)
        b, _ = head(ids[:1, 4:], f[:1, 4:], cache=cache)
        assert torch.allclose(head.norm(torch.cat([a, b], 1)), ref[:1], atol=1e-5)


def test_eagle1_runtime_matches_from_scratch_reference(tiny_target, eagle1):
    """Cache roll-back: after any acceptance pattern, proposals equal a from-scratch recomputation."""
    prompt = list(range(100, 113))
    checked = 0
    for tokens, proposal in drive(tiny_target, eagle1, prompt, accept=[0, 2, 4, 1, 3, 0], k=4):
        ref = reference_probs(eagle1.module, tiny_target, tokens, proposal.tokens.tolist(), fuse=lambda f: f)
        assert proposal.probs.shape == (4, 49152) and proposal.probs.dtype == torch.float32
        for q, r in zip(proposal.probs, ref):
            assert torch.allclose(q.log(), r.log(), atol=1e-4)  # relative: q is near-uniform over 49k tokens
        checked += 1
    assert checked == 6


def test_eagle_refuses_missing_features(tiny_target, eagle1):
    from draftsmith.errors import DraftsmithError

    eagle1.reset()
    with pytest.raises(DraftsmithError, match="feature_layers"):
        eagle1.update(torch.tensor([1, 2, 3]), None)


def test_causal_mask_exact():
    m = causal_mask(2, 3, torch.float32, torch.device("cpu"), padding=torch.tensor([[0, 1, 1, 1, 1]]))
    allowed = (m == 0).int()[0, 0]
    assert allowed.tolist() == [[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]]


def test_shift_left():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x, 1).tolist() == [[2, 3, 4, 0]]
    assert shift_left(x, 3, fill=-1).tolist() == [[4, -1, -1, -1]]
    assert shift_left(x, 5).tolist() == [[0, 0, 0, 0]]
