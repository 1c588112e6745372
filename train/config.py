"""Config of the training stage (``draftsmith train``): the recipe YAML's ``train:`` section.

Learning rate, schedule and losses live here; engine settings (ZeRO stage, bf16/fp32,
gradient accumulation, clipping) live in ``configs/deepspeed/<name>.json``, named by
``train.deepspeed``. The method is the drafter's ``type``; ``draftsmith drafters`` lists the trainable ones
(their one home: ``drafters/registry.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from torch import Tensor

from ..errors import ConfigError
from ..measure.config import EvalRecipe
from . import losses
from .losses import CORAL_TEMPERATURE, Reduction, TokenLoss


@dataclass
class OptimizerConfig:
    lr: float = 1e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's (β1, β2), each in [0, 1)."""
    eps: float = 1e-8

    def validate(self) -> None:
        # AdamW would refuse some of these itself, but only once the target has loaded
        if not self.lr > 0:
            raise ConfigError(f"train.optimizer.lr = {self.lr} must be > 0")
        if self.weight_decay < 0:
            raise ConfigError(f"train.optimizer.weight_decay = {self.weight_decay} must be ≥ 0")
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"train.optimizer.betas[{i}] = {beta} must be in [0, 1)")
        if not self.eps > 0:
            raise ConfigError(f"train.optimizer.eps = {self.eps} must be > 0")


@dataclass
class ScheduleConfig:
    kind: Literal["constant", "linear", "cosine"] = "cosine"
    """Decay after warmup: constant, linear to min_lr_ratio·lr, or cosine to min_lr_ratio·lr."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak."""

    def validate(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"train.schedule.warmup_steps = {self.warmup_steps} must be ≥ 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.schedule.min_lr_ratio = {self.min_lr_ratio} must be in [0, 1] "
                              "(the final learning rate as a fraction of the peak)")


@dataclass
class LossConfig:
    kind: TokenLoss = "forward_kl"
    """Token loss between the drafter's q and the target's p, one of ``train/losses.py:TOKEN_LOSS_FNS``: forward_kl,
    reverse_kl, jsd, tvd, ce (on the target's argmax), soft_ce (−Σ p log q; EAGLE's choice), or the LK losses that
    aim at the acceptance Σ min(p, q) itself, lk_alpha (−log of it) and lk_hybrid (KL blended into TV as it grows), or
    top_k_ce (HASS's top-K term alone, K = ``top_k``)."""
    temperature: float = 1.0
    """Both distributions are softmax(logits / temperature) inside the loss."""
    jsd_beta: float = 0.5
    """β of the generalized JSD (DistillSpec): 0.5 is symmetric JSD."""
    lk_eta: float = 3.0
    """η of ``lk_hybrid``: KL weighs exp(−η·α), TV the rest (the LK paper's and the reference trainer's 3)."""
    token_weight: float = 1.0
    """Weight of the token loss (EAGLE-1 uses 0.1 beside feature_weight 1.0)."""
    feature_weight: float = 0.0
    """Weight of the smooth-L1 feature regression (EAGLE-1 only; 1.0 in the paper)."""
    step_decay: float = 0.8
    """Weight decay per unrolled step (EAGLE-3) or per head (Medusa): weights 1, d, d², …"""
    top_k: int = 0
    """HASS's harmonized objective distillation: K ≥ 1 adds ``top_k_weight`` · −Σ_{x ∈ top-K(p)} p(x) log q(x) to every
    row's token loss (``losses.top_k_ce``; over a draft vocabulary, the top K of p renormalized there), weighed per
    unrolled step / head like the rest. HASS: K = 10. 0 = off."""
    top_k_weight: float = 1.0
    """w of the top-K term beside ``kind``'s loss (HASS: 1.0). Inside EAGLE-1's token loss it is scaled by
    ``token_weight`` too (HASS's own EAGLE head weighs the term 1 beside a classification loss of 0.1: w = 10 there)."""

    def validate(self) -> None:
        if self.temperature <= 0:
            raise ConfigError(f"train.loss.temperature = {self.temperature} must be > 0")
        if not 0.0 < self.jsd_beta < 1.0:
            raise ConfigError(f"train.loss.jsd_beta = {self.jsd_beta} must be in (0, 1)")
        if self.lk_eta < 0:
            raise ConfigError(f"train.loss.lk_eta = {self.lk_eta} must be ≥ 0")
        if self.token_weight < 0 or self.feature_weight < 0 or self.token_weight + self.feature_weight == 0:
            raise ConfigError("train.loss.token_weight and feature_weight must be ≥ 0 and not both 0")
        if not 0.0 < self.step_decay <= 1.0:
            raise ConfigError(f"train.loss.step_decay = {self.step_decay} must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"train.loss.top_k = {self.top_k} must be ≥ 0 (0 = no top-K term; HASS: 10)")
        if self.top_k_weight < 0:
            raise ConfigError(f"train.loss.top_k_weight = {self.top_k_weight} must be ≥ 0")
        if self.kind == "top_k_ce" and self.top_k < 1:
            raise ConfigError("train.loss.kind = top_k_ce needs train.loss.top_k ≥ 1, its K (HASS: 10)")

    def token_loss(self, draft_logits: Tensor, target_logits: Tensor, mask: Tensor,
                   reduction: Reduction = "mean") -> Tensor:
        """This section's token loss (``losses.token_loss``: ``kind``, its temperature, β, η, and the top-K term)."""
        return losses.token_loss(self.kind, draft_logits, target_logits, mask, self.temperature, self.jsd_beta,
                                 reduction=reduction, eta=self.lk_eta, top_k=self.top_k, top_k_weight=self.top_k_weight)


@dataclass
class OnPolicyConfig:
    fraction: float = 0.0
    """Share of micro-batches whose responses the drafter samples itself and the target scores
    (DistillSpec's on-policy data); 0 = only the dataset's responses, 1 = only on-policy."""
    max_new_tokens: int = 64
    """Length of each sampled response."""
    temperature: float = 1.0
    """Sampling temperature of the drafter."""

    def validate(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ConfigError(f"train.on_policy.fraction = {self.fraction} must be in [0, 1]")
        if self.max_new_tokens < 1:
            raise ConfigError(f"train.on_policy.max_new_tokens = {self.max_new_tokens} must be ≥ 1")
        if self.temperature <= 0:
            raise ConfigError(f"train.on_policy.temperature = {self.temperature} must be > 0")


@dataclass
class CheckpointConfig:
    every: int = 500
    """Optimizer steps between checkpoints (one is always written at the end); 0 = only at the end."""
    keep: int = 2
    """How many recent checkpoints to keep in <run_dir>/checkpoints (at least 1: a killed run resumes from it)."""

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"train.checkpoint.every = {self.every} must be ≥ 0 (0 = only at the end)")
        if self.keep < 1:
            raise ConfigError(f"train.checkpoint.keep = {self.keep} must be ≥ 1: the newest checkpoint is what a "
                              f"killed run resumes from")


@dataclass
class LoggingConfig:
    every: int = 10
    """Optimizer steps between log lines (jsonl, wandb, progress bar postfix); 0 = only the last step's."""
    wandb: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto = online when a wandb key is configured (WANDB_API_KEY or ~/.netrc), else offline."""
    wandb_project: str = "draftsmith"
    progress: bool = True
    """Show a progress bar (rank 0) with tokens/s and ETA."""

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"train.logging.every = {self.every} must be ≥ 0 (0 = only the last step's line)")


@dataclass
class TrainEvalConfig:
    heldout: int = 32
    """Records held out of training (chosen by seed) for the held-out metrics."""
    every: int = 0
    """Optimizer steps between held-out evaluations (expected acceptance Σ min(p, q), accuracy
    per unrolled step, loss, and ``sim_tau``, the acceptance length they predict at ``decode.k``, by
    which ``drafter-best/`` is kept); 0 = only at the end."""
    decoder_every: int = 0
    """Optimizer steps between evaluations in the real speculative decoder (τ, greedy, the recipe's
    ``decode``/``eval`` sections); 0 = never during training."""
    decoder_at_end: bool = False
    """Also evaluate the final drafter in the decoder."""
    decoder_prompts: int = 5
    """Prompts per decoder evaluation (from the recipe's ``eval.prompts``)."""

    def validate(self) -> None:
        for name in ("heldout", "every", "decoder_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.eval.{name} = {getattr(self, name)} must be ≥ 0")
        if self.decoder_prompts < 1:
            raise ConfigError(f"train.eval.decoder_prompts = {self.decoder_prompts} must be at least 1")


@dataclass
class DFlashTrainConfig:
    anchors: int = 64
    """Blocks trained per sequence, anchored at random answer positions (the reference samples up to 512)."""
    weighting: Literal["decay", "dpace"] = "decay"
    """How block positions weigh in the loss: ``decay`` = the reference's fixed exp(−(k−1)/γ); ``dpace`` = D-PACE
    (Dynamic Position-Aware Cross-Entropy, arXiv 2605.18810): per block, weights from the drafter's own
    confidence in the target's tokens, each position's share of the expected accepted length
    (``train/dflash.py:dpace_weights``)."""
    decay_gamma: float = 0.0
    """``decay``: block position k ≥ 1 weighs exp(−(k−1)/γ); 0 = 7 for blocks of 16 or more (z-lab and
    SpecForge at 16), else 4 (speculators' default at block 8)."""
    dpace_alpha: float = 0.5
    """``dpace``: the confidence smoothing q̃ = (1 − α)·q + α, in (0, 1] (the paper's and speculators' 0.5;
    1 = every valid position weighs its suffix length)."""

    def validate(self) -> None:
        if self.anchors < 1:
            raise ConfigError(f"train.dflash.anchors = {self.anchors} must be at least 1")
        if self.decay_gamma < 0:
            raise ConfigError(f"train.dflash.decay_gamma = {self.decay_gamma} must be ≥ 0 (0 = the reference's default)")
        if not 0.0 < self.dpace_alpha <= 1.0:
            raise ConfigError(f"train.dflash.dpace_alpha = {self.dpace_alpha} must be in (0, 1] (0 would make every "
                              f"weight after a confident miss vanish)")


@dataclass
class DFlash2TrainConfig:
    selector_alpha: float = 1.0
    """Weight of the candidate selector's K-way cross-entropy beside the unary loss (the reference's
    ``selector_loss_alpha``, 1); blocks, anchors and position weights are ``train.dflash``'s."""

    def validate(self) -> None:
        if self.selector_alpha < 0:
            raise ConfigError(f"train.dflash2.selector_alpha = {self.selector_alpha} must be ≥ 0")


@dataclass
class PEagleTrainConfig:
    down_sample_ratio: float = 0.7
    """COD sampling: depth d ≥ 1 trains a share max(r^d, r_min) of the rollouts (r, the reference's 0.7)."""
    down_sample_ratio_min: float = 0.2
    """r_min: the share of rollouts kept at every depth at least (the reference's 0.2)."""
    max_anchors: int = 0
    """Rollouts started per sequence at most, at random answer positions; 0 = every answer position (the reference's
    default). Bounds the entries of a forward, whose attention grows with their square."""

    def validate(self) -> None:
        if not 0.0 < self.down_sample_ratio <= 1.0:
            raise ConfigError(f"train.peagle.down_sample_ratio = {self.down_sample_ratio} must be in (0, 1]")
        if not 0.0 <= self.down_sample_ratio_min <= 1.0:
            raise ConfigError(f"train.peagle.down_sample_ratio_min = {self.down_sample_ratio_min} must be in [0, 1]")
        if self.max_anchors < 0:
            raise ConfigError(f"train.peagle.max_anchors = {self.max_anchors} must be ≥ 0 (0 = every answer position)")


@dataclass
class TrainConfig:
    dataset: str = ""
    """Tokenized dataset folder (``draftsmith prepare`` output: input_ids, loss_mask, …)."""
    features: str = ""
    """Offline feature cache folder; empty = run the frozen target online on every batch."""
    deepspeed: str = "zero2"
    """Engine settings: a name in configs/deepspeed/ (zero0 … zero3) or a path to a JSON file."""
    steps: int = 1000
    """Optimizer steps to train for."""
    batch_size: int = 4
    """Sequences per micro-batch per process (gradient accumulation is in the DeepSpeed JSON)."""
    max_length: int = 1024
    """Sequences are cut to this many tokens."""
    group_by_length: int = 0
    """Records of similar length share a micro-batch: the order is length-sorted within groups of this
    many optimizer steps (``data.BatchOrder``); 0 = random batches (the default). On the default demo's
    data, 16 made a step faster, but the demo's head trained so (one run) came out weaker than with random
    batches, so it stays opt-in until measured side by side (benchmarks/RESULTS.md, "train")."""
    seed: int = 0
    """Seeds the drafter's init, the data order and the held-out split."""
    max_records: int = 0
    """Train on only the first this many of the records left after the held-out split (0 = all of them):
    nested subsets of one dataset that share one held-out set, the points of a data-scaling curve
    (``benchmarks/data_curve.py``)."""
    max_bad_steps: int = 10
    """Micro-batches with a NaN/inf loss that are skipped (and counted) before the run stops."""
    ttt_steps: int = 7
    """EAGLE-3 training-time test: how many steps the head is unrolled on its own outputs."""
    align_top_k: int = 0
    """EAGLE-3, GRIFFIN's token-alignable training: a row's loss at unrolled step j ≥ 1 counts only while the target's
    token was in the head's top ``align_top_k`` at every earlier step (1 for chains, the tree's top-k for trees);
    0 = every row (EAGLE-3)."""
    feature_noise: float = 0.0
    """EAGLE-1/-3: add uniform noise U(−a, a) to the target features fed to the head (EAGLE: 0.1)."""
    coral_weight: float = 0.0
    """EAGLE-3, CORAL's cross-step representation alignment (Weng et al. 2025): the weight of an InfoNCE term that pulls
    the head's states at one position together across the unrolled steps (the other positions of the sequence are the
    negatives; ``train/losses.py:cross_step_alignment``), over the rows the token loss counts at each step, added per
    row to the token loss; 0 = off (EAGLE-3). Needs ``ttt_steps`` ≥ 2. ``benchmarks/levers.py`` measures 0.1."""
    coral_temperature: float = CORAL_TEMPERATURE
    """τ of that InfoNCE over cosine similarities (0.07, the contrastive default; CORAL's own could not be read)."""
    replay_weight: float = 0.0
    """EAGLE-3, Draft-OPD's on-policy states replayed offline (Lei et al. 2026): the (row, unrolled step) pairs that
    greedy chains of the head's own drafts reach when a record is decoded (each round up to its first miss, the miss
    included) weigh 1 + this in the token loss, the rest 1 (``train/eagle3.py:reached_by_chains``); 0 = off."""
    loss_positions: Literal["answer", "all"] = "answer"
    """Which tokens a training step learns to predict: ``answer`` (the records' loss mask: the assistant's tokens,
    as EAGLE and the reference trainers do) or ``all`` (every real token but the first, the prompt's included: the
    head learns the target's next-token distribution there too, more signal from each record). Held-out figures
    are over answer tokens either way."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the drafter's weights, with this decay per optimizer step (bias-corrected,
    ``train/ema.py``), and train on as usual: held-out figures, ``drafter/`` and ``drafter-best/`` are the average's,
    the raw weights' figures are logged beside them (``raw/…``) and their final drafter is ``drafter-raw/``. In (0, 1);
    the window is about 1/(1 − d) steps (0.99: the last ~100). None = off. ZeRO 0–2 (every rank holds the drafter)."""
    l2sp_weight: float = 0.0
    """L2-SP: λ of a pull ½ λ Σ‖w − w₀‖² of the trainable weights toward those training started from (``train/l2sp.py``;
    with ``drafter.init_from_layer`` the target's layer), added to the mean token loss; 0 = off. The distance moved,
    ‖w − w₀‖, is logged (``l2sp_distance``). ZeRO 0–2 (every rank holds the drafter)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: TrainEvalConfig = field(default_factory=TrainEvalConfig)
    dflash: DFlashTrainConfig = field(default_factory=DFlashTrainConfig)
    """DFlash's anchors and position weights (``train/dflash.py``; DFlash2's too)."""
    dflash2: DFlash2TrainConfig = field(default_factory=DFlash2TrainConfig)
    """DFlash2's candidate selector loss (``train/dflash2.py``)."""
    peagle: PEagleTrainConfig = field(default_factory=PEagleTrainConfig)
    """P-EAGLE's COD sampling of the depths trained (``train/peagle.py``)."""

    def validate(self) -> None:
        for name in ("steps", "batch_size", "max_length", "ttt_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} = {getattr(self, name)} must be at least 1")
        if self.group_by_length < 0:
            raise ConfigError(f"train.group_by_length = {self.group_by_length} must be ≥ 0 (0 = random batches)")
        if self.max_records < 0:
            raise ConfigError(f"train.max_records = {self.max_records} must be ≥ 0 (0 = every record)")
        if self.max_bad_steps < 0:
            raise ConfigError(f"train.max_bad_steps = {self.max_bad_steps} must be ≥ 0")
        if self.align_top_k < 0:
            raise ConfigError(f"train.align_top_k = {self.align_top_k} must be ≥ 0 (0 = off)")
        if self.feature_noise < 0:
            raise ConfigError(f"train.feature_noise = {self.feature_noise} must be ≥ 0")
        if self.coral_weight < 0:
            raise ConfigError(f"train.coral_weight = {self.coral_weight} must be ≥ 0 (0 = off)")
        if self.coral_weight and self.ttt_steps < 2:
            raise ConfigError(f"train.coral_weight = {self.coral_weight} aligns the head's states across unrolled steps: "
                              f"it needs train.ttt_steps ≥ 2, got {self.ttt_steps}")
        if self.replay_weight < 0:
            raise ConfigError(f"train.replay_weight = {self.replay_weight} must be ≥ 0 (0 = off)")
        if self.coral_temperature <= 0:
            raise ConfigError(f"train.coral_temperature = {self.coral_temperature} must be > 0")
        if self.l2sp_weight < 0:
            raise ConfigError(f"train.l2sp_weight = {self.l2sp_weight} must be ≥ 0 (0 = off)")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"train.ema_decay = {self.ema_decay} must be in (0, 1) (e.g. 0.99), or null for no average")


FAMILY_KEYS = ("ttt_steps", "align_top_k", "feature_noise", "coral_weight", "coral_temperature", "replay_weight",
               "loss.token_weight",
               "loss.feature_weight", "loss.step_decay", "on_policy", "dflash", "dflash2", "peagle")
"""The keys of this section (a field, or a whole sub-section) that only some methods' recipes read; the rest every
recipe reads. Each recipe in ``train/`` names those it reads in its module's ``READS`` (a tuple of these names), and
``draftsmith train`` refuses a recipe that sets one its method would ignore (:func:`unread`)."""


def unread(cfg: TrainConfig, reads: tuple[str, ...]) -> list[str]:
    """The :data:`FAMILY_KEYS` that ``cfg`` sets away from their defaults and a recipe reading ``reads`` ignores."""
    default = TrainConfig()

    def value(section: Any, key: str) -> Any:
        for part in key.split("."):
            section = getattr(section, part)
        return section

    return [key for key in FAMILY_KEYS if key not in reads and value(cfg, key) != value(default, key)]


class TrainRecipe(EvalRecipe, Protocol):
    """What ``draftsmith train`` reads of the recipe: the run folder, the target, the drafter to train, this
    section, and what the training-time evaluation reads (``decode``, ``eval.prompts``). The top-level
    ``config.Recipe`` satisfies it (``config`` lies above this stage: it imports the section)."""

    train: TrainConfig
