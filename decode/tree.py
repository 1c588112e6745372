"""Tree speculative decoding: the drafter proposes a tree of continuations of the last committed
token t, the target scores every node in ONE forward (a tree attention mask: each node sees the
committed tokens, t and its own ancestors; position ids = t's position + depth), a lossless rule
accepts one root-to-node path and emits one more token, and the target's KV cache keeps the rows
of that path only (gathered, the rest dropped).

A tree (:class:`DraftTree`) lists its nodes parents-first; among siblings, index order is the order
in which they were drawn. Row r of the verification is the root t (r = 0) or node r − 1.

**Verification.** Greedy: follow the child whose token is the target's argmax, stop where there is
none and emit that argmax: the output is the target's own greedy output. Sampling: multi-candidate
recursive rejection sampling. At a node with target distribution p and the draft distribution q its
children were drawn from, try the children in order; accept child x with probability
min(1, p(x)/q(x)) (then continue at x with x's own p and q); after a rejection

* p ← norm(max(0, p − q)) (the residual, as in the chain rule of Chen et al. 2023), and
* for children drawn *without* replacement (distinct tokens; what :func:`build_tree` drafts):
  q ← q with x removed, renormalized — recursive rejection sampling without replacement
  (Jeon et al. 2024, "Recursive Speculative Decoding: Accelerating LLM Inference via Sampling
  Without Replacement", RSD; the verification of Sequoia, Chen et al. 2024, is the same rule);
  for children drawn i.i.d. *with* replacement (duplicates possible)
  q stays as it is (SpecInfer, Miao et al. 2024; Yang et al. 2024 "Multi-candidate speculative
  decoding");

and when every child is rejected, sample from the current p (the plain target distribution at a
node without children: the bonus token).

Why the output is exactly p (both variants), by induction over the children left at a node: let
child j be drawn from q_j (q, minus the earlier children when drawn without replacement; that IS
its conditional law given the earlier draws) and suppose the procedure from child j+1 on outputs
p_{j+1} = norm(max(0, p_j − q_j)) whatever x_j was (p_{j+1} does not depend on x_j; with no child
left it samples p_{j+1} directly). Then the output law is min(p_j, q_j) + (1 − Σ min(p_j, q_j))
p_{j+1} = p_j. Under an accepted child the same holds one level down, because that child's children
were drawn from the drafter given that child alone. What a drafter may NOT do is decide whether a
child exists by looking at that child's own value (pruning a drawn child for its low q biases the
output): :func:`build_tree` decides every child slot before drawing it, from its parent's values
and the draws made so far only — a stopping rule, which the induction allows.

**Shapes.** :class:`StaticTree`: a fixed tree of child ranks (Medusa-style; path (0, 2) = the third
draw under the first draw). :class:`DynamicTree` (EAGLE-2, Li et al. 2024): grow depth by depth,
expanding the ``top_k`` best child slots by path confidence, then fill the rest of a total node
budget with the best remaining slots. A slot's confidence is its parent's path confidence times
the j-th largest probability of the parent's draft distribution — in greedy mode exactly EAGLE-2's
score of the j-th top token; in sampling mode a value fixed before the slot is drawn, which keeps
the verification exact (see above).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import DraftsmithError
from ..target import Target, keep_cache_rows
from .rounds import DecodeResult, Verified, decode_rounds, gate
from .protocol import BindsTargetCache, Drafter, Proposal, TreeDrafter
from .sampling import Warp

# ------------------------------------------------------------------ tree shapes

STATIC_TREES: dict[str, tuple[tuple[int, ...], ...]] = {
    # 16 nodes, depth 4: four first tokens, more alternatives near the root where acceptance is likelier
    "default": (
        (0,), (1,), (2,), (3,),
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
        (0, 0, 0, 0), (0, 1, 0, 0),
    ),
    # 4 nodes: the chain of depth 4 (a check that a static tree can be a chain)
    "chain4": ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)),
}


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree of child ranks: path (c_1, …, c_d) is the c_d-th child drawn under path (c_1, …, c_{d-1}).

    Every prefix of a path is a path, and a node with child c > 0 also has child c − 1 (siblings are
    the first draws, in order — what keeps sampling exact).
    """

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        have = set(self.paths)
        if not self.paths:
            raise DraftsmithError("a static tree needs at least one path")
        for p in self.paths:
            if not p or any(c < 0 for c in p):
                raise DraftsmithError(f"static tree path {list(p)} must be a non-empty list of ranks ≥ 0")
            if len(p) > 1 and p[:-1] not in have:
                raise DraftsmithError(f"static tree path {list(p)} has no parent path {list(p[:-1])}")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in have:
                raise DraftsmithError(f"static tree path {list(p)} needs its elder sibling {list(p[:-1] + (p[-1] - 1,))}")
        if len(have) != len(self.paths):
            raise DraftsmithError("static tree paths must be distinct")

    @classmethod
    def named_or_given(cls, spec: str | list[list[int]] | tuple) -> StaticTree:
        """A named default (:data:`STATIC_TREES`) or a list of paths."""
        if isinstance(spec, str):
            if spec not in STATIC_TREES:
                raise DraftsmithError(f"unknown static tree '{spec}'; named trees: {', '.join(STATIC_TREES)}, "
                                      f"or give a list of paths such as [[0], [1], [0, 0]]")
            return cls(STATIC_TREES[spec])
        return cls(tuple(tuple(int(c) for c in p) for p in spec))

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def size(self) -> int:
        return len(self.paths)


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree: ``depth`` levels, ``top_k`` slots expanded per level, ``budget`` nodes in all
    (the confidence gate is the decoder's ``min_confidence``, as for chains: :func:`build_tree`)."""

    depth: int = 5
    top_k: int = 8
    budget: int = 63

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.budget < 1:
            raise DraftsmithError(f"a dynamic tree needs depth, top_k and budget ≥ 1, got {self.depth}, "
                                  f"{self.top_k}, {self.budget}")

    @property
    def size(self) -> int:
        return self.budget


TreeShape = StaticTree | DynamicTree


# ------------------------------------------------------------------ the tree


@dataclass
class DraftTree:
    """Drafted nodes below the root (the last committed token t), parents first."""

    tokens: Tensor
    """[N] long, the token of each node."""
    parents: Tensor
    """[N] long, the parent node of each node; −1 for a child of the root."""
    q: Tensor | None
    """[N+1, V] float32 warped draft distributions, row 0 at the root and row i+1 at node i: what the
    children of that row were drawn from (rows without children are unused); None in greedy mode."""
    replacement: bool = False
    """Children drawn i.i.d. with replacement (duplicates possible) rather than without."""

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def depths(self) -> list[int]:
        """Depth of every node (children of the root: 1)."""
        out: list[int] = []
        for p in self.parents.tolist():
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self) -> list[list[int]]:
        """For every row (0 = root, i+1 = node i), its child nodes in drawing order."""
        kids: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i)
        return kids

    def ancestors(self) -> Tensor:
        """[N+1, N+1] bool: row r may attend row c (c is r, the root, or an ancestor of r)."""
        n = self.size
        anc = torch.eye(n + 1, dtype=torch.bool)
        anc[:, 0] = True
        for i, p in enumerate(self.parents.tolist()):
            anc[i + 1] |= anc[p + 1]
            anc[i + 1, i + 1] = True
        return anc

    def truncated(self, max_depth: int) -> DraftTree:
        """The nodes at depth ≤ max_depth (a value-free cut: sampling stays exact)."""
        keep = [i for i, d in enumerate(self.depths()) if d <= max_depth]
        if len(keep) == self.size:
            return self
        index = {old: new for new, old in enumerate(keep)}
        parents = [index[p] if p >= 0 else -1 for p in self.parents[keep].tolist()]
        q = None if self.q is None else self.q[[0] + [i + 1 for i in keep]]
        return DraftTree(self.tokens[keep], torch.tensor(parents, dtype=torch.long, device=self.tokens.device), q,
                         self.replacement)


def chain_tree(proposal: Proposal) -> DraftTree:
    """A chain proposal as the degenerate tree: node i is the child of node i − 1."""
    k = proposal.tokens.shape[0]
    parents = torch.arange(-1, k - 1, device=proposal.tokens.device)
    q = None
    if proposal.probs is not None:
        q = torch.cat([proposal.probs[:k], proposal.probs.new_zeros(1, proposal.probs.shape[-1])])  # leaf row unused
    return DraftTree(proposal.tokens, parents, q)


def with_chain(tree: DraftTree, chain: Tensor) -> DraftTree:
    """Greedy trees only: ``tree`` plus ``chain`` as a branch from the root, sharing the nodes whose tokens
    match (the chain follows the tree's child with its token while there is one, then grows new nodes,
    appended after the tree's so parents stay first). Greedy verification follows the target's argmax, so
    any tree is exact there; a sampled tree's children must all come from the q its row records, which a
    second drafter's chain does not, so this refuses one with q."""
    if tree.q is not None:
        raise DraftsmithError("with_chain merges greedy trees only (a sampled tree's children come from one q per row)")
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    kids: dict[int, dict[int, int]] = {}
    for i, (tok, par) in enumerate(zip(tokens, parents)):
        kids.setdefault(par, {}).setdefault(tok, i)
    at = -1
    for tok in chain.tolist():
        node = kids.get(at, {}).get(tok)
        if node is None:
            tokens.append(tok)
            parents.append(at)
            node = len(tokens) - 1
            kids.setdefault(at, {})[tok] = node
        at = node
    device = tree.tokens.device
    return DraftTree(torch.tensor(tokens, dtype=torch.long, device=device),
                     torch.tensor(parents, dtype=torch.long, device=device), None, tree.replacement)


def tree_attention_mask(tree: DraftTree, past: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive mask [1, 1, N+1, past+N+1]: every row sees the ``past`` cached rows and its tree ancestors.

    Allowed entries are 0, the others the dtype's minimum — the 4-D form transformers passes to the
    attention as it is (``masking_utils._preprocess_mask_arguments`` returns a 4-D mask unchanged),
    valid for SDPA and eager attention alike.
    """
    n = tree.size + 1
    allowed = torch.ones(n, past + n, dtype=torch.bool, device=device)
    allowed[:, past:] = tree.ancestors().to(device)
    mask = torch.zeros(1, 1, n, past + n, dtype=dtype, device=device)
    return mask.masked_fill(~allowed[None, None], torch.finfo(dtype).min)


def tree_position_ids(tree: DraftTree, start: int, device: torch.device) -> Tensor:
    """[1, N+1] positions: the root at ``start``, a node at start + depth."""
    return torch.tensor([[start] + [start + d for d in tree.depths()]], device=device)


# ------------------------------------------------------------------ verification


def verify_greedy(tree: DraftTree, target_argmax: Tensor) -> tuple[list[int], int]:
    """target_argmax: [N+1] the target's argmax at every row. Returns (accepted path of nodes, next token)."""
    argmax = target_argmax.tolist()
    tokens = tree.tokens.tolist()
    kids = tree.children()
    path: list[int] = []
    row = 0
    while True:
        want = argmax[row]
        child = next((c for c in kids[row] if tokens[c] == want), None)
        if child is None:
            return path, want
        path.append(child)
        row = child + 1


def reject_update(p: Tensor, q: Tensor, x: int, replacement: bool) -> tuple[Tensor, Tensor]:
    """After rejecting child x: the residual p and the law of the next child (see the module docstring)."""
    residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    p = residual / total if total > 0 else p  # zero only when p ≤ q everywhere, where rejection has probability 0
    if not replacement:
        q = q.clone()
        q[x] = 0.0
        mass = q.sum()
        q = q / mass if mass > 0 else q
    return p, q


def verify_sampling(tree: DraftTree, p: Tensor, generator: torch.Generator | None) -> tuple[list[int], int]:
    """Recursive rejection sampling over the tree. p: [N+1, V] warped target distributions per row.

    Returns (accepted path of nodes, next token); the emitted tokens follow the target's law exactly.
    """
    if tree.q is None or tree.q.shape != p.shape:
        shape = None if tree.q is None else tuple(tree.q.shape)
        raise DraftsmithError(f"drafter returned tree probs of shape {shape} for {tree.size} nodes; sampling needs "
                              f"[N+1, {p.shape[-1]}] warped distributions over the target's vocabulary")
    tokens = tree.tokens.tolist()
    kids = tree.children()
    path: list[int] = []
    row = 0
    while True:
        pr, q = p[row], tree.q[row]
        for child in kids[row]:
            x = tokens[child]
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * float(q[x]) < float(pr[x]):  # u < p/q, exact for q(x) = 0 too
                path.append(child)
                row = child + 1
                break
            pr, q = reject_update(pr, q, x, tree.replacement)
        else:
            return path, int(torch.multinomial(pr, 1, generator=generator))


# ------------------------------------------------------------------ building trees

Expand = Callable[[list[int], list[int], list[int]], Tensor]
"""expand(new_nodes, tokens, parents) → [len(new_nodes), V] drafter logits at each new node (the
distribution of its children), given the tree so far (``tokens``/``parents`` of every node)."""


@dataclass
class _Build:
    warp: Warp
    generator: torch.Generator | None
    replacement: bool
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    score: list[float] = field(default_factory=list)  # path confidence of each row (row 0 = root)
    logits: list[Tensor | None] = field(default_factory=list)  # per row: drafter logits [V] once expanded
    q: list[Tensor | None] = field(default_factory=list)  # per row: warped q (sampling) once expanded
    conf: list[Tensor | None] = field(default_factory=list)  # per row: softmax (greedy) or q: slot keys, scores
    drawn: list[list[int]] = field(default_factory=list)  # per row: tokens of its children so far

    def __post_init__(self) -> None:
        # row 0 is the root (the last committed token, not a node of the tree): per-row state only
        for per_row in (self.logits, self.q, self.conf):
            per_row.append(None)
        self.score.append(1.0)
        self.drawn.append([])

    def set_dist(self, row: int, logits: Tensor) -> None:
        self.logits[row] = logits
        self.q[row] = None if self.warp.greedy else self.warp.probs(logits)
        self.conf[row] = logits.float().softmax(-1) if self.q[row] is None else self.q[row]

    def add_row(self, token: int, parent_row: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent_row - 1)
        for per_row in (self.logits, self.q, self.conf):
            per_row.append(None)
        self.score.append(score)
        self.drawn.append([])
        return len(self.tokens)  # the new row

    def draw(self, row: int, m: int) -> list[int]:
        """m more children of ``row`` (greedy: the next best tokens; sampling: the next draws) → their rows."""
        logits = self.logits[row]
        taken = self.drawn[row]
        if self.warp.greedy:
            scores = logits.float().clone()
            if taken:
                scores[taken] = float("-inf")
            top = torch.topk(scores, min(m, int(torch.isfinite(scores).sum())))
            picks = top.indices.tolist()
        elif self.replacement:
            picks = torch.multinomial(self.q[row], m, replacement=True, generator=self.generator).tolist()
        else:
            q = self.q[row].clone()
            if taken:
                q[taken] = 0.0
            picks = gumbel_top_k(q, min(m, int((q > 0).sum())), self.generator)
        conf = self.conf[row]
        rows = []
        for x in picks:
            rows.append(self.add_row(x, row, self.score[row] * float(conf[x])))
            self.drawn[row].append(x)
        return rows

    def slot_keys(self, row: int, k: int) -> list[float]:
        """Confidence of the next k child slots of ``row``: its path confidence times the largest
        probabilities of its distribution left undrawn — known before the slots are drawn (greedy:
        exactly the scores of the next best tokens)."""
        conf = self.conf[row]
        if self.drawn[row]:
            conf = conf.clone()
            conf[self.drawn[row]] = 0.0
        vals = torch.topk(conf, min(k, conf.shape[-1])).values.tolist()
        return [self.score[row] * v for v in vals if v > 0]

    def tree(self, device: torch.device) -> DraftTree:
        tokens = torch.tensor(self.tokens, dtype=torch.long, device=device)
        parents = torch.tensor(self.parents, dtype=torch.long, device=device)
        q = None
        if not self.warp.greedy:
            zero = torch.zeros_like(self.q[0])
            q = torch.stack([r if r is not None else zero for r in self.q])
        return DraftTree(tokens, parents, q, self.replacement)


def gumbel_top_k(q: Tensor, m: int, generator: torch.Generator | None) -> list[int]:
    """m distinct tokens drawn one after another without replacement from q [V] (Gumbel-top-k:
    the order of the perturbed log-probabilities is the order of sequential draws)."""
    if m <= 0:
        return []
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=torch.float64).clamp_min(1e-300)
    keys = q.double().log() - (-u.log()).log()  # log q + Gumbel noise; −inf where q = 0
    return torch.topk(keys, m).indices.tolist()


def build_tree(
    shape: TreeShape,
    root_logits: Tensor,
    expand: Expand,
    warp: Warp,
    generator: torch.Generator | None,
    max_depth: int | None = None,
    replacement: bool = False,
    min_confidence: float = 0.0,
) -> DraftTree:
    """Draft a tree of ``shape`` below the root. root_logits: [V] the drafter's logits for the root's
    children; expand: the drafter's forward over new nodes (see :data:`Expand`), called once per level.
    max_depth caps the depth (e.g. Medusa's number of heads); replacement (static trees only) draws
    siblings i.i.d. instead of distinct. min_confidence: the confidence gate of a dynamic tree: a slot whose
    confidence (known before it is drawn, see the module docstring) is below it is not drafted, so a round
    where the drafter is unsure verifies fewer nodes, or none (a plain target step). It is a stopping rule on
    values fixed before the draws, so verification stays exact; 0 = off (EAGLE-2). A static tree is fixed:
    no gate."""
    if replacement and not isinstance(shape, StaticTree):
        raise DraftsmithError("children drawn with replacement are supported for static trees only")
    if not 0.0 <= min_confidence < 1.0:
        raise DraftsmithError(f"the confidence gate min_confidence must be in [0, 1), got {min_confidence}")
    b = _Build(warp, generator, replacement)
    b.set_dist(0, root_logits)
    depth = min(shape.depth, max_depth) if max_depth is not None else shape.depth

    def expand_rows(rows: list[int]) -> None:
        if rows:
            logits = expand([r - 1 for r in rows], list(b.tokens), list(b.parents))  # [len(rows), V]
            for r, row_logits in zip(rows, logits):
                b.set_dist(r, row_logits)

    if isinstance(shape, StaticTree):
        row_of: dict[tuple[int, ...], int] = {(): 0}
        for d in range(1, depth + 1):
            level = sorted(p for p in shape.paths if len(p) == d)
            for parent in sorted({p[:-1] for p in level}):
                if parent not in row_of:
                    continue  # cut: the drafter's distribution had fewer tokens than ranks
                want = max(p[-1] for p in level if p[:-1] == parent) + 1
                for rank, row in enumerate(b.draw(row_of[parent], want)):
                    row_of[parent + (rank,)] = row
            has_children = {p[:-1] for p in shape.paths if len(p) == d + 1}
            if d < depth:
                expand_rows([row_of[p] for p in level if p in row_of and p in has_children])
    else:
        frontier = [0]
        leftover: list[tuple[float, int, int]] = []  # (key, row, slot index) of slots not drawn yet
        for d in range(1, depth + 1):
            room = shape.budget - len(b.tokens)
            if room <= 0 or not frontier:
                break
            slots = [(key, row, j) for row in frontier for j, key in enumerate(b.slot_keys(row, shape.top_k))
                     if key >= min_confidence]
            slots.sort(key=lambda s: (-s[0], s[1], s[2]))  # per parent, keys fall with j: the gate and the cut keep a prefix
            take, rest = slots[: min(shape.top_k, room)], slots[min(shape.top_k, room):]
            leftover += rest
            new_rows: list[int] = []
            for row in dict.fromkeys(r for _, r, _ in take):
                new_rows += b.draw(row, sum(1 for _, r, _ in take if r == row))
            if d < depth:
                expand_rows(new_rows)
            frontier = new_rows
        room = shape.budget - len(b.tokens)
        if room > 0 and leftover:  # fill the budget with the best slots left, decided before drawing them
            leftover.sort(key=lambda s: (-s[0], s[1], s[2]))
            chosen = leftover[:room]
            for row in dict.fromkeys(r for _, r, _ in chosen):
                b.draw(row, sum(1 for _, r, _ in chosen if r == row))
    return b.tree(root_logits.device)


# ------------------------------------------------------------------ the loop


@torch.inference_mode()
def tree_decode(
    target: Target, drafter: Drafter, prompt_ids: list[int], *, tree: TreeShape, max_new_tokens: int,
    warp: Warp = Warp(), seed: int = 0, min_confidence: float = 0.0,
) -> DecodeResult:
    """Decode one prompt with draft trees of ``tree``'s shape. Greedy mode reproduces the target's greedy output.

    min_confidence: the confidence gate, as in the chain decoder (0 = off; lossless either way). A
    :class:`~.protocol.TreeDrafter` drafts trees and takes the gate with them (:func:`build_tree`: dynamic
    trees only); any other drafter's ``propose(depth, …)`` chain is verified as the one-branch tree, cut
    where the running product of its confidences falls under the gate, and a :class:`~.protocol.Gated`
    drafter stops drafting there. A :class:`~.protocol.BindsTargetCache` drafter is
    refused: its drafted rows would sit in the cache a tree verification writes.
    """
    if isinstance(drafter, BindsTargetCache):
        raise DraftsmithError("a drafter that drafts inside the target's KV cache (layer skip with "
                              "drafter.share_cache=true) cannot draft trees; use decode.tree=none or "
                              "drafter.share_cache=false")
    device = target.device
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = target.new_cache()
    drafts_trees = isinstance(drafter, TreeDrafter)

    def tree_round(token: int, committed: int, room: int) -> Verified:
        if room == 0:
            draft = DraftTree(torch.empty(0, dtype=torch.long, device=device), torch.empty(0, dtype=torch.long, device=device),
                              None if warp.greedy else torch.zeros(1, target.vocab_size, device=device))
        elif drafts_trees:
            draft = drafter.propose_tree(tree, warp, gen, min_confidence).truncated(room)
        else:
            proposal = drafter.propose(room, warp, gen)
            draft = chain_tree(proposal)
            if min_confidence > 0 and proposal.confidence is not None:  # reads the drafter only: lossless
                draft = draft.truncated(gate(proposal.confidence[: draft.size], min_confidence))
        ids = torch.cat([torch.tensor([token], device=device), draft.tokens])[None]  # [1, N+1]
        out = target.forward(ids, cache, drafter.feature_layers,
                             position_ids=tree_position_ids(draft, committed, device),
                             attention_mask=tree_attention_mask(draft, committed, target.dtype, device))
        logits = out.logits[0]  # [N+1, V]
        if warp.greedy:
            path, token = verify_greedy(draft, logits.argmax(-1))
        else:
            path, token = verify_sampling(draft, warp.probs(logits), gen)
        rows = torch.tensor([0] + [i + 1 for i in path], device=device)  # [n+1] rows of t and the accepted path
        keep_cache_rows(cache, committed, rows)  # t and the accepted path; the next token is fed next round
        features = None if out.features is None else out.features[0, rows]  # [n+1, F]
        return Verified(draft.tokens[path].tolist(), token, features, max(draft.depths(), default=0), draft.size)

    return decode_rounds(target, drafter, prompt_ids, tree_round, cache=cache, generator=gen, warp=warp,
                         depth=tree.depth, max_new_tokens=max_new_tokens,
                         min_confidence=0.0 if drafts_trees else min_confidence)
