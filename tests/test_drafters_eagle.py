"""EAGLE-1 / EAGLE-3 heads: shapes and dtypes, parity with transformers, the runtime's cache
roll-back against a from-scratch reference, and (EAGLE-3) the training-time-test unroll."""

from __future__ import annotations

import copy

import pytest
import torch

from draftsmith.decode.sampling import Warp
from draftsmith.drafters.common import causal_mask, shift_left
from draftsmith.drafters.eagle1 import Eagle1Config
from draftsmith.drafters.eagle3 import Eagle3Config, attend
from draftsmith.errors import ConfigError
from draftsmith.target import Target, default_eagle3_layers

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

SAMPLE = Warp(temperature=1.0)


def features(target: Target, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """[len(tokens), F] target features of every position (one uncached forward)."""
    return target.forward(torch.tensor([tokens]), feature_layers=layers).features[0]


def drive(target: Target, drafter, prompt: list[int], accept: list[int], k: int, seed: int = 0, warp: Warp = SAMPLE):
    """Run the drafter protocol by hand, as the decoder does, accepting accept[i] drafts in round i.

    Yields (committed tokens, proposal) before each round's acceptance.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = list(prompt) + [11]
    drafter.reset()
    drafter.update(torch.tensor(tokens), features(target, prompt, drafter.feature_layers))
    for i, m in enumerate(accept):
        proposal = drafter.propose(k, warp, gen)
        yield list(tokens), proposal
        m = min(m, proposal.tokens.shape[0])
        new = proposal.tokens[:m].tolist() + [(97 * (i + 3)) % 5000]
        n = len(tokens)
        f = features(target, tokens + new[:-1], drafter.feature_layers)  # positions 0 … n+m-1
        drafter.update(torch.tensor(new), f[n - 1 : n + m])  # the verified positions n-1 … n+m-1
        tokens += new


def reference_probs(drafter, target, tokens: list[int], drafts: list[int], fuse) -> list[torch.Tensor]:
    """The draft distributions recomputed from scratch: no cache, true features for committed rows."""
    head = drafter.module
    f = features(target, tokens[:-1], drafter.feature_layers)  # f_0 … f_{n-2}
    rows = fuse(f)[None]  # [1, n-1, H]
    ids = tokens[1:]
    out = []
    for d in drafts:
        hidden, logits = head(torch.tensor([ids]), rows)
        out.append(SAMPLE.probs(head.target_logits(logits[0, -1])))
        rows = torch.cat([rows, hidden[:, -1:]], dim=1)  # the predicted feature feeds the next row
        ids = ids + [d]
    return out


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
        ref = reference_probs(eagle1, tiny_target, tokens, proposal.tokens.tolist(), fuse=lambda f: f)
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


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_logits_to_keep_gives_the_last_rows_logits_exactly(tiny_target, family, request):
    """The decoder's catch-up asks for the last row's logits only: the same numbers, the other rows skipped."""
    drafter = request.getfixturevalue(family)
    head = drafter.module
    x = torch.randint(0, 5000, (1, 7), generator=torch.Generator().manual_seed(4))
    f = features(tiny_target, x[0].tolist(), drafter.feature_layers)[None]
    with torch.no_grad():
        hidden, logits = head(x, f)
        for keep in (1, 3):
            h, kept = head(x, f, logits_to_keep=keep)
            assert kept.shape[1] == keep and torch.equal(h, hidden)
            assert torch.allclose(kept, logits[:, -keep:], atol=1e-6)


@pytest.mark.parametrize("family", ["eagle1", "eagle3", "eagle31", "eagle3_deep"])
def test_every_eagle_head_speaks_the_surface_the_runtime_calls(family, request):
    """``EagleHead`` is the runtime's whole use of a head: each head has its members, and its ``forward`` takes the
    protocol's arguments by the same names (runtime_checkable alone sees only that the names exist)."""
    import inspect

    from draftsmith.drafters.eagle_runtime import EagleHead
    from draftsmith.drafters.peagle import PEagleHead

    head = request.getfixturevalue(family).module
    assert isinstance(head, EagleHead)
    wanted = list(inspect.signature(EagleHead.forward).parameters)[1:]
    for cls in (type(head), PEagleHead):
        params = inspect.signature(cls.forward).parameters
        assert all(name in params for name in wanted), f"{cls.__name__}.forward lacks {set(wanted) - set(params)}"
    assert not isinstance(torch.nn.Linear(2, 2), EagleHead)


def test_causal_mask_exact():
    m = causal_mask(2, 3, torch.float32, torch.device("cpu"), padding=torch.tensor([[0, 1, 1, 1, 1]]))
    allowed = (m == 0).int()[0, 0]
    assert allowed.tolist() == [[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]]


def test_shift_left():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x, 1).tolist() == [[2, 3, 4, 0]]
    assert shift_left(x, 3, fill=-1).tolist() == [[4, -1, -1, -1]]
    assert shift_left(x, 5).tolist() == [[0, 0, 0, 0]]


# ---------------------------------------------------------------- EAGLE-3

LAYERS = [0, 2, -1]  # the tiny target has 4 layers


def sparse_vocab(v: int = 49152, vd: int = 3000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random reduced vocabulary in the EAGLE-3 convention (sorted ids, d2t offsets, t2d mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(v, generator=g)[:vd].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(vd), t2d


@pytest.fixture(scope="module")
def eagle3(tiny_target):
    cfg = Eagle3Config(feature_layers=LAYERS, seed=5)
    return cfg.runtime(cfg.build_module(tiny_target, sparse_vocab()), tiny_target)


@pytest.fixture(scope="module")
def eagle31(tiny_target):
    """The EAGLE-3.1 options on (per-layer fc norms, the normed state passed on), norm scales moved off 1."""
    cfg = Eagle3Config(feature_layers=LAYERS, seed=5, fc_norm=True, norm_output=True)
    head = cfg.build_module(tiny_target, sparse_vocab())
    with torch.no_grad():
        for norm in head.fc_norm:
            norm.weight.mul_(torch.linspace(0.5, 1.5, 64))
    return cfg.runtime(head, tiny_target)


@pytest.fixture(scope="module")
def eagle3_deep(tiny_target):
    """A two-layer head: EAGLE-3's 2H-input layer, then a plain layer."""
    cfg = Eagle3Config(feature_layers=LAYERS, seed=5, num_layers=2)
    return cfg.runtime(cfg.build_module(tiny_target, sparse_vocab()), tiny_target)


def test_eagle3_default_layers_follow_the_field():
    assert default_eagle3_layers(30) == (1, 14, 26)  # SmolLM2-135M
    assert default_eagle3_layers(32) == (1, 15, 28)  # Llama-3.1-8B: SGLang captures 2, 16, 29 (inputs)


def test_eagle3_shapes_dtypes_vocab_and_trainable_parts(tiny_target, eagle3):
    head = eagle3.module
    assert eagle3.feature_layers == (0, 2, 3)
    ids = torch.randint(0, 1000, (2, 6))
    hidden, logits = head(ids, torch.randn(2, 6, 3 * 64))
    assert hidden.shape == (2, 6, 64) and logits.shape == (2, 6, 3000)
    hidden2, logits2 = head(ids, hidden)  # its own output feeds the next step
    assert hidden2.shape == (2, 6, 64) and logits2.dtype == torch.float32
    full = head.target_logits(logits[0, 0])
    assert full.shape == (49152,)
    d2t, t2d = sparse_vocab()
    assert torch.equal(full[t2d], logits[0, 0]) and torch.isinf(full[~t2d]).all()
    assert torch.equal(head.draft_ids, torch.arange(3000) + d2t)
    assert torch.equal(head.lm_head.weight, tiny_target.model.lm_head.weight[head.draft_ids])
    trainable = {n.split(".")[0] for n, p in head.named_parameters() if p.requires_grad}
    assert trainable == {"fc", "midlayer", "norm", "lm_head"}
    bf = Target(copy.deepcopy(tiny_target.model).to(torch.bfloat16), tiny_target.tokenizer, "bf", fingerprint="x")
    head_bf = Eagle3Config(feature_layers=LAYERS).build_module(bf)
    h, lg = head_bf(ids, torch.randn(2, 6, 192, dtype=torch.bfloat16))
    assert h.dtype == lg.dtype == torch.bfloat16 and lg.shape == (2, 6, 49152)  # default: the full vocabulary
    assert head_bf.t2d.all() and not head_bf.d2t.any()


def test_eagle3_layer_with_zero_embedding_matches_transformers(eagle3):
    """Our 2H-input layer = transformers' LlamaDecoderLayer when the embedding half is zero.

    With emb = 0, input_layernorm(emb) = 0, so q/k/v only see W[:, H:] @ hidden_norm(hidden): a
    LlamaDecoderLayer whose input norm is our hidden_norm and whose projections are W[:, H:].
    """
    from transformers import LlamaModel

    head = eagle3.module
    layer = head.midlayer
    hf = LlamaModel(head.layer_config).eval()
    hf.norm = torch.nn.Identity()
    ref_layer = hf.layers[0]
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(ref_layer.self_attn, name).weight.copy_(getattr(layer.self_attn, name).weight[:, 64:])
        ref_layer.self_attn.o_proj.load_state_dict(layer.self_attn.o_proj.state_dict())
        ref_layer.mlp.load_state_dict(layer.mlp.state_dict())
        ref_layer.input_layernorm.load_state_dict(layer.hidden_norm.state_dict())
        ref_layer.post_attention_layernorm.load_state_dict(layer.post_attention_layernorm.state_dict())
        torch.manual_seed(1)
        h = torch.randn(2, 7, 64)
        pad = torch.tensor([[1] * 7, [0, 0] + [1] * 5])  # left padding in row 1
        pos = (pad.cumsum(-1) - 1).clamp_min(0)
        ref = hf(inputs_embeds=h, attention_mask=pad, position_ids=pos).last_hidden_state
        cos, sin = head.rotary_emb(h, pos)
        mask = causal_mask(7, 0, h.dtype, h.device, pad)
        ours = sum(layer(torch.zeros_like(h), h, cos, sin, mask))  # (stream, MLP output): the layer's output is their sum
        assert torch.allclose(ours[0], ref[0], atol=1e-5)
        assert torch.allclose(ours[1, 2:], ref[1, 2:], atol=1e-5)
        # through a cache in two chunks = one pass
        cache = head.new_cache()
        p = torch.arange(7)[None]
        cos, sin = head.rotary_emb(h, p)
        a = sum(layer(torch.zeros_like(h[:1, :3]), h[:1, :3], cos[:, :3], sin[:, :3], causal_mask(3, 0, h.dtype, h.device), cache))
        b = sum(layer(torch.zeros_like(h[:1, 3:]), h[:1, 3:], cos[:, 3:], sin[:, 3:], causal_mask(4, 3, h.dtype, h.device), cache))
        ref = hf(inputs_embeds=h[:1]).last_hidden_state
        assert torch.allclose(torch.cat([a, b], 1), ref, atol=1e-5)


def test_ttt_attention_equals_explicit_block_mask():
    """The diagonal trick = SDPA over [k0, k1 … kj] with the mask EAGLE-3's TTT implies."""
    torch.manual_seed(0)
    b, h, s, d, j = 2, 3, 5, 8, 3
    q = torch.randn(b, h, s, d)
    ks = [torch.randn(b, h, s, d) for _ in range(j + 1)]
    vs = [torch.randn(b, h, s, d) for _ in range(j + 1)]
    mask = causal_mask(s, 0, torch.float32, torch.device("cpu"))
    ours = attend(q, ks[0], vs[0], mask, ks[1:], vs[1:], d**-0.5)
    eye = torch.eye(s, dtype=torch.bool)
    allowed = torch.cat([torch.tril(torch.ones(s, s, dtype=torch.bool))] + [eye] * j, dim=1)  # [S, (j+1)S]
    ref = torch.nn.functional.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=allowed)
    assert torch.allclose(ours, ref, atol=1e-5)


@pytest.mark.parametrize("family", ["eagle3", "eagle31", "eagle3_deep"])
def test_unroll_equals_chained_decoding(tiny_target, family, request):
    """Step j, row t of the unroll = the (j+1)-th chained draft after true rows 0 … t (teacher-forced tokens)."""
    eagle3 = request.getfixturevalue(family)
    head = eagle3.module
    torch.manual_seed(2)
    x = torch.randint(0, 5000, (1, 9))
    f = features(tiny_target, x[0].tolist(), eagle3.feature_layers)[None]  # [1, 9, 192]
    with torch.no_grad():
        steps = head.unroll(x, f, steps=3)
        for t in range(9):
            rows, ids = head.fc(head.fuse(f[:, : t + 1])), x[:, 1 : t + 2]
            for j in range(3):
                if t + j + 2 > 8:
                    break
                hidden, logits = head(ids, rows)
                assert torch.allclose(logits[0, -1], steps[j][1][0, t], atol=1e-4), (t, j)
                assert torch.allclose(hidden[0, -1], steps[j][0][0, t], atol=1e-4), (t, j)
                rows = torch.cat([rows, hidden[:, -1:]], 1)
                ids = torch.cat([ids, x[:, t + j + 2 : t + j + 3]], 1)


def test_unroll_backpropagates_into_trainable_parts_only(tiny_target):
    head = Eagle3Config(feature_layers=LAYERS).build_module(tiny_target)
    x = torch.randint(0, 5000, (2, 6))
    steps = head.unroll(x, torch.randn(2, 6, 192), steps=2, attention_mask=torch.tensor([[1] * 6, [1] * 4 + [0] * 2]))
    sum(lg.float().logsumexp(-1).sum() for _, lg in steps).backward()
    assert head.fc.weight.grad is not None and head.midlayer.self_attn.q_proj.weight.grad.abs().sum() > 0
    assert head.embed_tokens.weight.grad is None


@pytest.mark.parametrize("family", ["eagle3", "eagle31", "eagle3_deep"])
def test_eagle3_runtime_matches_from_scratch_reference(tiny_target, family, request):
    eagle3 = request.getfixturevalue(family)
    prompt = list(range(300, 311))
    _, t2d = sparse_vocab()
    for tokens, proposal in drive(tiny_target, eagle3, prompt, accept=[0, 3, 4, 1], k=4):
        assert t2d[proposal.tokens].all()  # drafts come from the draft vocabulary
        assert (proposal.probs[:, ~t2d] == 0).all()  # q is zero outside it
        ref = reference_probs(eagle3, tiny_target, tokens, proposal.tokens.tolist(),
                              fuse=lambda f: eagle3.module.fc(eagle3.module.fuse(f)))
        for q, r in zip(proposal.probs, ref):
            assert torch.allclose(q[t2d].log(), r[t2d].log(), atol=1e-4)


def test_eagle3_greedy_drafts_the_argmax_over_its_draft_vocabulary_with_its_confidence(tiny_target, eagle3):
    """Greedy drafting works on the [Vd] logits (no [V] tensor): the same tokens, mapped to target ids, and
    the same top-1 confidence as the from-scratch reference over the target's vocabulary."""
    prompt = list(range(300, 311))
    for tokens, proposal in drive(tiny_target, eagle3, prompt, accept=[0, 3, 4, 1], k=4, warp=Warp()):
        assert proposal.probs is None
        ref = reference_probs(eagle3, tiny_target, tokens, proposal.tokens.tolist(),
                              fuse=lambda f: eagle3.module.fc(eagle3.module.fuse(f)))
        assert proposal.tokens.tolist() == [int(r.argmax()) for r in ref]
        assert torch.allclose(proposal.confidence, torch.stack([r.max() for r in ref]), atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(feature_layers=[1, 2]), "drafter.feature_layers"),
        (dict(feature_layers=[0, 1, 4]), r"drafter.feature_layers\[2\]"),
        (dict(feature_layers=[0, -5, 1]), r"drafter.feature_layers\[1\]"),
        (dict(feature_layers=[1, 1, 2]), "drafter.feature_layers"),
        (dict(feature_layers=LAYERS, draft_vocab_size=50000), "drafter.draft_vocab_size"),
        (dict(feature_layers=LAYERS, draft_vocab_size=1000), "drafter.draft_vocab"),
    ],
)
def test_eagle3_bad_config_names_the_field(tiny_target, kwargs, field):
    with pytest.raises(ConfigError, match=field):
        Eagle3Config(**kwargs).build(tiny_target)


def test_eagle3_bad_vocab_refused(tiny_target):
    d2t, t2d = sparse_vocab()
    bad = t2d.clone()
    bad[~t2d.nonzero()[0]] = True  # one extra target id marked
    for vocab, msg in [((d2t, bad), "t2d does not mark"), ((d2t, t2d[:100]), "covers 100 tokens"), ((d2t + 50000, t2d), "outside")]:
        with pytest.raises(ConfigError, match=msg):
            Eagle3Config(feature_layers=LAYERS).build_module(tiny_target, vocab)
    with pytest.raises(ConfigError, match="draft_vocab_size = 10 but"):
        Eagle3Config(feature_layers=LAYERS, draft_vocab_size=10).build_module(tiny_target, (d2t, t2d))


def test_eagle3_vocab_file_is_read_and_checked_against_the_targets_tokenizer(tiny_target, tmp_path):
    from draftsmith.data.vocab import DraftVocab
    from draftsmith.errors import DraftsmithError

    d2t, t2d = sparse_vocab()
    path = str(tmp_path / "draft_vocab.safetensors")
    DraftVocab(d2t, t2d, coverage=0.9, tokenizer_hash=tiny_target.tokenizer_hash).save(path)
    head = Eagle3Config(feature_layers=LAYERS, draft_vocab=path).build_module(tiny_target)
    assert torch.equal(head.draft_ids, t2d.nonzero()[:, 0])
    DraftVocab(d2t, t2d, coverage=0.9, tokenizer_hash="another-tokenizer").save(path)
    with pytest.raises(ConfigError, match="counted on data rendered with tokenizer another-tokenizer, not with this target"):
        Eagle3Config(feature_layers=LAYERS, draft_vocab=path).build_module(tiny_target)
    (tmp_path / "draft_vocab.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(DraftsmithError, match="cannot be read as safetensors with tensors d2t and t2d"):
        Eagle3Config(feature_layers=LAYERS, draft_vocab=path).build_module(tiny_target)
    with pytest.raises(DraftsmithError, match="does not exist; run `draftsmith prepare`"):
        Eagle3Config(feature_layers=LAYERS, draft_vocab=str(tmp_path / "missing")).build_module(tiny_target)


def test_unroll_logits_rows_are_the_full_logits_at_those_rows(tiny_target, eagle3):
    """Training asks for the logits of the rows a loss reads only: the same numbers, row-major."""
    head = eagle3.module
    torch.manual_seed(5)
    x = torch.randint(0, 5000, (2, 7))
    f = torch.randn(2, 7, 192)
    attention = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    keep = [torch.rand(2, 7) > 0.5 for _ in range(2)]
    with torch.no_grad():
        full = head.unroll(x, f, steps=2, attention_mask=attention)
        kept = head.unroll(x, f, steps=2, attention_mask=attention, logits_rows=keep)
    for j in range(2):
        assert kept[j][1].shape == (int(keep[j].sum()), full[j][1].shape[-1])
        assert torch.allclose(kept[j][1], full[j][1][keep[j]], atol=1e-5)
        assert torch.equal(kept[j][0], full[j][0])


# ---------------------------------------------------------------- EAGLE-3.1 options


def test_fc_norm_and_norm_before_fc_make_fc_see_features_of_one_scale(tiny_target):
    """fc_norm: each layer's features scaled alone leave the head's output unchanged; norm_before_fc: only all
    three scaled together do; without either, any scale shows."""
    torch.manual_seed(3)
    x, f = torch.randint(0, 5000, (1, 6)), torch.randn(1, 6, 192)
    one_layer = f.clone()
    one_layer[..., 64:128] *= 40.0  # the middle layer at another scale (Gemma-3's reach ~850 RMS)
    heads = {name: Eagle3Config(feature_layers=LAYERS, **{name: True} if name else {}).build_module(tiny_target)
             for name in ("", "fc_norm", "norm_before_fc")}
    with torch.no_grad():
        out = {name: [head(x, g)[1] for g in (f, one_layer, f * 40.0)] for name, head in heads.items()}
    assert not torch.allclose(out[""][0], out[""][1], atol=1e-3) and not torch.allclose(out[""][0], out[""][2], atol=1e-3)
    assert torch.allclose(out["fc_norm"][0], out["fc_norm"][1], atol=1e-4)
    assert torch.allclose(out["fc_norm"][0], out["fc_norm"][2], atol=1e-4)
    assert not torch.allclose(out["norm_before_fc"][0], out["norm_before_fc"][1], atol=1e-3)
    assert torch.allclose(out["norm_before_fc"][0], out["norm_before_fc"][2], atol=1e-4)
    assert {n for n, _ in heads["fc_norm"].named_parameters()} - {n for n, _ in heads[""].named_parameters()} == {
        "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    assert heads["norm_before_fc"].input_norm.weight.shape == (192,) and heads[""].fc_norm is None


def test_norm_output_passes_the_normed_state_on(tiny_target):
    """Same weights: step 0's logits are equal, its passed-on state is norm(pre-norm state), so step 1 differs."""
    plain = Eagle3Config(feature_layers=LAYERS).build_module(tiny_target)
    normed = Eagle3Config(feature_layers=LAYERS, norm_output=True).build_module(tiny_target)
    normed.load_state_dict(plain.state_dict())
    torch.manual_seed(4)
    x, f = torch.randint(0, 5000, (1, 7)), torch.randn(1, 7, 192)
    with torch.no_grad():
        (h0, l0), (h1, l1) = plain.unroll(x, f, steps=2)
        (n0, m0), (n1, m1) = normed.unroll(x, f, steps=2)
        assert torch.allclose(m0, l0, atol=1e-5) and torch.allclose(n0, plain.norm(h0), atol=1e-5)
        assert not torch.allclose(m1, l1, atol=1e-3)


def test_the_options_come_from_the_recipe_and_survive_save_and_load(tiny_target, tmp_path):
    from draftsmith import drafters
    from draftsmith.config import load_recipe

    recipe = load_recipe("smollm2-135m-eagle3", [f"drafter.feature_layers={LAYERS}", "drafter.draft_vocab=",
                                                 "drafter.norm_before_fc=true", "drafter.norm_output=true"])
    head = recipe.drafter.build_module(tiny_target)
    assert head.input_norm is not None and head.fc_norm is None and head.norm_output
    with torch.no_grad():
        head.input_norm.weight.mul_(torch.linspace(0.5, 1.5, 192))
    drafters.save(str(tmp_path / "head"), recipe.drafter, head, tiny_target)
    back = drafters.load(str(tmp_path / "head"), tiny_target).module
    assert back.norm_output and torch.equal(back.input_norm.weight, head.input_norm.weight)
    with pytest.raises(ConfigError, match="drafter.fc_norm and drafter.norm_before_fc exclude each other"):
        load_recipe("smollm2-135m-eagle3", ["drafter.fc_norm=true", "drafter.norm_before_fc=true"])


def test_init_from_layer_makes_the_head_the_targets_next_layer(tiny_target):
    """fc passes the highest fused layer (2) through and the head's layer is the target's layer 3 on it, blind to the
    token: step 0 reproduces the target's output of layer 3 and, with its final norm and lm_head, its logits."""
    head = Eagle3Config(feature_layers=[0, 1, 2], init_from_layer=-1).build_module(tiny_target)  # full vocabulary
    ids = torch.randint(0, 1000, (2, 7))
    out = tiny_target.forward(ids, feature_layers=(0, 1, 2, 3))
    hidden, logits = head(shift_left(ids, 1), out.features[..., :192])
    assert torch.allclose(hidden, out.features[..., 192:], atol=1e-5)
    assert torch.allclose(logits, out.logits, atol=1e-4)
    assert head.midlayer.self_attn.q_proj.weight[:, :64].abs().sum() == 0  # the embedding half starts at zero
    plain = Eagle3Config(feature_layers=[0, 1, 2]).build_module(tiny_target)
    assert not torch.allclose(plain(shift_left(ids, 1), out.features[..., :192])[1], out.logits, atol=1e-2)


def test_a_two_layer_head_keeps_the_one_layer_weights_and_survives_save_and_load(tiny_target, eagle3, eagle3_deep,
                                                                                   tmp_path):
    from draftsmith import drafters

    one, two = eagle3.module.state_dict(), eagle3_deep.module.state_dict()
    assert {k for k in two if k not in one} == {k for k in two if k.startswith("next_layers.0.")} != set()
    assert all(torch.equal(one[k], two[k]) for k in one)  # the extra layer is drawn after every other weight
    assert "next_layers.0.self_attn.q_proj.weight" in two and two["next_layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert eagle3_deep.module.new_cache() is not None
    drafters.save(str(tmp_path / "deep"), eagle3_deep.config, eagle3_deep.module, tiny_target)
    back = drafters.load(str(tmp_path / "deep"), tiny_target)
    assert back.module.num_layers == 2 and all(torch.equal(back.module.state_dict()[k], v) for k, v in two.items())


def test_freeze_lm_head_leaves_the_targets_rows_untrained(tiny_target):
    head = Eagle3Config(feature_layers=LAYERS, freeze_lm_head=True).build_module(tiny_target, sparse_vocab())
    trainable = {n.split(".")[0] for n, p in head.named_parameters() if p.requires_grad}
    assert trainable == {"fc", "midlayer", "norm"}
    steps = head.unroll(torch.randint(0, 5000, (1, 6)), torch.randn(1, 6, 192), steps=2)
    sum(lg.float().logsumexp(-1).sum() for _, lg in steps).backward()
    assert head.lm_head.weight.grad is None and head.fc.weight.grad is not None
