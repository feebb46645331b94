"""Layer: plugin tooling (no SGLang import). Training loop shared by the three drafters.

Each step draws sequences (prompt + the target's answer) with the frozen target's features at
`target_layer_ids` (computed once for all sequences: `FeatureCache`), and trains the drafter on
the answer part:
- block drafters (dspark, dflash): `anchors_per_seq` random anchors per sequence; loss =
  sum_k w_k CE(step k logits, target token), w_k = exp(-k / decay) (position decay as in
  DFlash/DeepSpec); DSpark's steps are teacher-forced through the Markov head;
- eagle: the same CE over every answer position and unrolled step (training-time test).
Confidence heads learn BCE against "the draft equals the target token" on detached features, on
the steps a verifier would reach (every earlier step of the block/chain right): that is what the
confidence means in the loop, P(step k accepted | steps < k accepted).
With `w_tv` > 0 (drafters for sampling, `dist_loss.py`) the loss is w_ce * CE + w_tv * TV(p_target,
q_draft) per position and the confidence target is the acceptance probability 1 - TV, weighted by
the probability of reaching the position; the cache must then hold the target's final hidden states.
The learning rate follows warmup + cosine over progress = max(step / steps, elapsed / time limit),
so a run cut by its time limit still ends annealed. AdamW is fused on CUDA.
`evaluate` (e.g. the greedy accept length on a validation split, `walk_eval.py`) runs at the
progress points `eval_at`, off the training clock: its history is the learning curve, and with
`keep_best` the drafter ends with the weights of the best evaluation (early stopping).
Resumable: after every evaluation `snapshot` receives a `TrainState` (step, training seconds,
curve, history, best score, whether the current weights are the best); `train_drafter(resume=...)`
continues from one: the step counter, the training clock (so the time budget and learning-rate
schedule continue), the evaluation points still ahead and the best score carry over. A resume
loses the AdamW moments (a fresh optimizer, re-warmed over `resume_warmup` steps) and the data
order (the sampler is reseeded with seed + step).
"""
from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kllm_plugins.plugins.dspark.core.drafters import BlockDrafter, EagleDrafter, SharedTarget
from kllm_plugins.plugins.dspark.core.target_llama import LlamaTarget
from kllm_plugins.plugins.dspark.training.data import pad_batch
from kllm_plugins.plugins.dspark.training.dist_loss import block_dist_losses, eagle_dist_losses
from kllm_plugins.plugins.dspark.training.feature_cache import FeatureCache

logger = logging.getLogger("kllm.dspark")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    anchors_per_seq: int = 32
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    decay: float = 4.0
    confidence_weight: float = 1.0
    seed: int = 0
    log_every: int = 50
    time_limit_s: float = 0.0
    eval_at: tuple[float, ...] = ()
    keep_best: bool = True
    # distribution-matching loss (sampling drafters): w_ce * CE + w_tv * TV(p_target, q_draft);
    # w_tv = 0 is the greedy runs' CE loss (w_ce is then ignored)
    w_ce: float = 1.0
    w_tv: float = 0.0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.anchors_per_seq < 1:
            raise ValueError("steps, batch_size and anchors_per_seq must be >= 1")
        if self.w_ce < 0 or self.w_tv < 0 or (self.w_tv > 0 and self.w_ce + self.w_tv <= 0):
            raise ValueError("w_ce and w_tv must be >= 0")
        if any(not 0.0 < f <= 1.0 for f in self.eval_at) or list(self.eval_at) != sorted(self.eval_at):
            raise ValueError("eval_at must be increasing progress fractions in (0, 1]")


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def sample_anchors(plen: torch.Tensor, lens: torch.Tensor, gamma: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """n anchors per row, uniform in [plen, len - 1 - gamma] (rows must have room for one block)."""
    lo = plen.float()
    hi = (lens - 1 - gamma).float()
    u = torch.rand((plen.shape[0], n), generator=gen).to(plen.device)
    return (lo.unsqueeze(1) + u * (hi - lo + 1).unsqueeze(1)).floor().long().clamp(max=(lens - 1 - gamma).unsqueeze(1))


def reached(hit: torch.Tensor) -> torch.Tensor:
    """[..., gamma] bool: step k is reached when every step before it is right (step 0 always)."""
    ones = torch.ones_like(hit[..., :1], dtype=torch.long)
    return torch.cat([ones, hit[..., :-1].long()], dim=-1).cumprod(dim=-1).bool()


def block_losses(out: dict[str, torch.Tensor], decay: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    logits, labels, conf = out["logits"], out["labels"], out["confidence"]
    g = labels.shape[-1]
    w = torch.exp(-torch.arange(g, device=labels.device, dtype=torch.float32) / decay)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(labels.shape)
    ce_loss = (ce * w).sum() / (w.sum() * labels[..., 0].numel())
    hit = logits.argmax(-1) == labels
    reach = reached(hit)
    r = reach.float()  # a weighted mean, not conf[reach]: no device sync
    bce = F.binary_cross_entropy_with_logits(conf.float(), hit.float(), reduction="none")
    conf_loss = (bce * r).sum() / r.sum().clamp_min(1.0)
    hit = hit.float()
    accepted = reach[..., 1:].float().sum(-1) + hit[..., -1] * reach[..., -1]
    # tensors: converted only when logged (no device sync per step)
    return ce_loss, conf_loss, {"acc_k1": hit[..., 0].mean(), "acc_mean": hit.mean(), "accept_len_tf": 1 + accepted.mean()}


def eagle_reached(hit: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B,gamma,T]: step j at position p continues the chain whose step j-1 sits at p-1."""
    reach = torch.zeros_like(mask)
    reach[:, 0] = mask[:, 0]
    for j in range(1, mask.shape[1]):
        reach[:, j, 1:] = reach[:, j - 1, :-1] & hit[:, j - 1, :-1] & mask[:, j, 1:]
    return reach


def eagle_losses(shared: SharedTarget, out: dict[str, torch.Tensor], decay: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    hidden, labels, mask, conf = out["hidden"], out["labels"], out["mask"], out["confidence"]
    g = labels.shape[1]
    w = torch.exp(-torch.arange(g, device=labels.device, dtype=torch.float32) / decay).view(1, g, 1).expand_as(mask)
    sel_h, sel_y, sel_w = hidden[mask], labels[mask], w[mask]
    logits = shared.logits(sel_h)
    ce = F.cross_entropy(logits, sel_y, reduction="none")
    ce_loss = (ce * sel_w).sum() / sel_w.sum().clamp_min(1e-6)
    hit_sel = logits.argmax(-1) == sel_y
    hit = torch.zeros_like(mask)
    hit[mask] = hit_sel
    reach = eagle_reached(hit, mask)
    conf_loss = F.binary_cross_entropy_with_logits(conf[reach], hit[reach].float())
    step1 = mask[:, 0]
    acc1 = (hit[:, 0] & step1).sum() / step1.sum().clamp_min(1)
    return ce_loss, conf_loss, {"acc_k1": acc1, "acc_mean": hit_sel.float().mean()}


def drafter_step(cache: FeatureCache, shared: SharedTarget, drafter: nn.Module, index: Sequence[int],
                 cfg: TrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    tokens, plen, lens, feats = cache.batch(index)
    dist = cfg.w_tv > 0
    final = cache.final_batch(index) if dist else None
    with _autocast(tokens.device):
        if isinstance(drafter, EagleDrafter):
            out = drafter.train_forward(shared, feats, tokens, plen, lens - 1)
            if final is not None:
                return eagle_dist_losses(shared.logits, out, final, cfg.decay, cfg.w_ce, cfg.w_tv)
            return eagle_losses(shared, out, cfg.decay)
        assert isinstance(drafter, BlockDrafter)
        anchors = sample_anchors(plen, lens, drafter.gamma, cfg.anchors_per_seq, gen)
        out = drafter.train_forward(shared, feats, tokens, anchors)
        if final is not None:
            # the target's distribution of the token at anchor + k + 1 is read at anchor + k
            b, n, g = out["labels"].shape
            pos = (anchors.unsqueeze(-1) + torch.arange(g, device=anchors.device)).reshape(b, n * g, 1)
            h = final.gather(1, pos.expand(b, n * g, final.shape[-1])).view(b, n, g, -1)
            return block_dist_losses(out, shared.logits(h), cfg.decay, cfg.w_ce, cfg.w_tv)
        return block_losses(out, cfg.decay)


@dataclass
class TrainState:
    """What a later process needs to continue training (beside the drafter's weights)."""

    step: int
    train_seconds: float
    progress: float
    curve: list[dict[str, float]]
    history: list[dict[str, float]]
    best_score: float
    best_is_current: bool
    done: bool = False
    best_weights: dict[str, torch.Tensor] | None = None  # when not best_is_current (not serialized)

    def to_dict(self) -> dict[str, object]:
        return {"step": self.step, "train_seconds": self.train_seconds, "progress": self.progress,
                "curve": self.curve, "history": self.history,
                "best_score": self.best_score if math.isfinite(self.best_score) else None,
                "best_is_current": self.best_is_current, "done": self.done}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> "TrainState":
        best = d.get("best_score")
        return cls(step=int(d["step"]), train_seconds=float(d["train_seconds"]),  # type: ignore[arg-type]
                   progress=float(d["progress"]), curve=list(d["curve"]),  # type: ignore[arg-type]
                   history=list(d["history"]), best_score=-math.inf if best is None else float(best),  # type: ignore[arg-type]
                   best_is_current=bool(d["best_is_current"]), done=bool(d.get("done", False)))


class BestKeeper:
    """Evaluations off the training clock; the weights of the best one (a copy on the device)."""

    def __init__(self, drafter: nn.Module, evaluate: Callable[[nn.Module], float] | None, keep_best: bool) -> None:
        self.drafter, self.evaluate, self.keep_best = drafter, evaluate, keep_best
        self.curve: list[dict[str, float]] = []
        self.best: dict[str, torch.Tensor] | None = None
        self.best_score = -math.inf
        self.last_is_best = False

    def __call__(self, progress: float, step: int, train_seconds: float) -> float:
        """Evaluate now; returns the seconds it took (to be taken off the training clock)."""
        if self.evaluate is None:
            return 0.0
        t = time.perf_counter()
        self.drafter.eval()
        score = float(self.evaluate(self.drafter))
        self.drafter.train()
        if score > self.best_score:
            self.best_score = score
            if self.keep_best:
                self.best = {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}
        spent = time.perf_counter() - t
        self.curve.append({"progress": round(progress, 4), "step": step, "train_seconds": train_seconds,
                           "val": score, "eval_seconds": spent})
        logger.info("eval at %.0f%% (step %d): %.4f", 100 * progress, step, score)
        self.last_is_best = score >= self.best_score
        return spent

    def restore(self) -> None:
        if self.best is not None:
            self.drafter.load_state_dict(self.best)


def train_drafter(target: LlamaTarget, drafter: nn.Module, seqs: Sequence[tuple[list[int], int]], cfg: TrainConfig,
                  cache: FeatureCache | None = None, evaluate: Callable[[nn.Module], float] | None = None,
                  curve: list[dict[str, float]] | None = None, *, snapshot: Callable[[TrainState], None] | None = None,
                  resume: TrainState | None = None, best_weights: dict[str, torch.Tensor] | None = None,
                  resume_warmup: int = 50) -> list[dict[str, float]]:
    """Train in place; returns the logged history. Sequences need >= gamma + 1 answer tokens.

    `cache` (built over exactly `seqs`) is reused when given, e.g. by several drafters of one process.
    `evaluate` runs at `cfg.eval_at` (off the clock); its points are appended to `curve`, and with
    `cfg.keep_best` the best-scoring weights are restored at the end.
    `snapshot` is called after every evaluation (off the clock); `resume` continues a snapshot's
    run (the drafter must hold that snapshot's weights; `best_weights`, when the best evaluation
    was an earlier one, its weights).
    """
    gamma = drafter.cfg.block_size  # type: ignore[attr-defined]
    layers = list(drafter.cfg.target_layer_ids)  # type: ignore[attr-defined]
    usable = [i for i, s in enumerate(seqs) if len(s[0]) - s[1] >= gamma + 1]
    if not usable:
        raise ValueError("no training sequence has an answer longer than the block")
    t_cache = time.perf_counter()
    if cache is None:
        cache = FeatureCache(target, seqs, layers, final_hidden=cfg.w_tv > 0)
    elif cache.num_seqs != len(seqs):
        raise ValueError("the feature cache was built over other sequences")
    if cfg.w_tv > 0 and cache.final is None:
        raise ValueError("w_tv > 0 needs a feature cache built with final_hidden=True")
    shared = SharedTarget(target.embed, target.lm_head)
    params = [p for p in drafter.parameters() if p.requires_grad]
    fused = target.device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), fused=fused)
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[dict[str, float]] = []
    keeper = BestKeeper(drafter, evaluate, cfg.keep_best)
    pending = list(cfg.eval_at)
    first, warm_from = 0, 0
    if resume is not None:
        first, warm_from = resume.step, resume.step
        history = list(resume.history)
        keeper.curve = list(resume.curve)
        keeper.best_score = resume.best_score
        if cfg.keep_best and math.isfinite(resume.best_score):
            src = drafter.state_dict() if resume.best_is_current or best_weights is None else best_weights
            keeper.best = {k: v.detach().clone().to(drafter.state_dict()[k].device) for k, v in src.items()}
        pending = [f for f in pending if f > resume.progress]
        rng = random.Random(cfg.seed * 1_000_003 + resume.step)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + resume.step)
        logger.info("train %s: resumed at step %d (%.1fs trained, progress %.3f)", drafter.cfg.kind,  # type: ignore[attr-defined]
                    resume.step, resume.train_seconds, resume.progress)
    t0 = time.perf_counter() - (resume.train_seconds if resume is not None else 0.0)
    logger.info("train %s: feature cache %.1fs", drafter.cfg.kind, time.perf_counter() - t_cache)  # type: ignore[attr-defined]
    drafter.train()
    warmup = cfg.warmup if resume is None else resume_warmup

    def take_snapshot(step_now: int, elapsed_now: float, progress_now: float, done: bool) -> None:
        nonlocal t0
        if snapshot is None:
            return
        t = time.perf_counter()
        current = keeper.last_is_best or evaluate is None or keeper.best is None
        snapshot(TrainState(step=step_now, train_seconds=elapsed_now, progress=progress_now, curve=list(keeper.curve),
                            history=list(history), best_score=keeper.best_score, best_is_current=current, done=done,
                            best_weights=None if current else keeper.best))
        t0 += time.perf_counter() - t  # off the training clock

    progress, step = 0.0, first
    for step in range(first, cfg.steps):
        elapsed = time.perf_counter() - t0
        progress = max(step / cfg.steps, elapsed / cfg.time_limit_s if cfg.time_limit_s else 0.0)
        evaluated = False
        while pending and progress >= pending[0] and pending[0] < 1.0:
            t0 += keeper(pending.pop(0), step, elapsed)
            evaluated = True
        if evaluated:
            take_snapshot(step, elapsed, progress, False)
        if progress >= 1.0:
            logger.info("train: time limit reached at step %d", step)
            history.append({"step": step - 1, "stopped_by_time_limit": 1.0, "seconds": elapsed})
            break
        lr = cfg.lr * min(1.0, (step + 1 - warm_from) / warmup) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = [usable[rng.randrange(len(usable))] for _ in range(cfg.batch_size)]
        ce, conf, info = drafter_step(cache, shared, drafter, batch, cfg, gen)
        loss = ce + cfg.confidence_weight * conf
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            rec = {"step": step, "ce": float(ce.detach()), "conf_bce": float(conf.detach()), "lr": lr,
                   "seconds": time.perf_counter() - t0, **{k: float(v) for k, v in info.items()}}
            if cfg.w_tv > 0:
                rec["loss"] = float(ce.detach())  # "ce" is then the info's CE part alone
            history.append(rec)
            logger.info("train %s step %d ce %.3f acc@1 %.3f acc %.3f", drafter.cfg.kind, step, rec["ce"],  # type: ignore[attr-defined]
                        rec["acc_k1"], rec["acc_mean"])
    end_step = max(h["step"] for h in history) + 1 if history else step
    if pending:  # the end of training (time limit or last step) is the 100% point
        keeper(1.0, end_step, time.perf_counter() - t0)
    take_snapshot(end_step, time.perf_counter() - t0, 1.0, True)
    keeper.restore()
    if curve is not None:
        curve.extend(keeper.curve)
    drafter.eval()
    return history


@torch.no_grad()
def teacher_forced_confidence(target: LlamaTarget, drafter: nn.Module, seqs: Sequence[tuple[list[int], int]],
                              anchors_per_seq: int = 16, batch_size: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw confidence logits, outcomes (draft == target token) and validity, [N, gamma], for calibration.

    Valid are the steps a verifier reaches (all earlier steps right); there the teacher-forced
    outcome at step k is exactly "accepted given steps < k accepted", as in the loop.
    For eagle, rows are chains (one per anchor) and validity masks steps past the answer end.
    """
    gamma = drafter.cfg.block_size  # type: ignore[attr-defined]
    layers = list(drafter.cfg.target_layer_ids)  # type: ignore[attr-defined]
    shared = SharedTarget(target.embed, target.lm_head)
    usable = [s for s in seqs if len(s[0]) - s[1] >= gamma + 1]
    gen = torch.Generator().manual_seed(seed)
    logits_all, hit_all, valid_all = [], [], []
    for lo in range(0, len(usable), batch_size):
        tokens, plen, lens = pad_batch(usable[lo:lo + batch_size], 0, target.device)
        _, feats = target.full_forward(tokens, capture_layers=layers, want_logits=False)
        with _autocast(target.device):
            if isinstance(drafter, EagleDrafter):
                out = drafter.train_forward(shared, feats, tokens, plen, lens - 1)
                hit = (shared.logits(out["hidden"]).argmax(-1) == out["labels"])
                # [B,g,T] -> chains [B*T, g]: step j of the chain anchored at a sits at p = a + j - 2
                b, g, t = hit.shape
                conf = torch.full((b, t, g), 0.0, device=hit.device)
                h2 = torch.zeros((b, t, g), dtype=torch.bool, device=hit.device)
                v2 = torch.zeros((b, t, g), dtype=torch.bool, device=hit.device)
                for j in range(1, g + 1):
                    a = torch.arange(t, device=hit.device)
                    p = a + j - 2
                    ok = (p >= 0) & (p < t)
                    conf[:, ok, j - 1] = out["confidence"][:, j - 1, p[ok]].float()
                    h2[:, ok, j - 1] = hit[:, j - 1, p[ok]]
                    v2[:, ok, j - 1] = out["mask"][:, j - 1, p[ok]]
                keep = v2[..., 0]
                logits_all.append(conf[keep].cpu())
                hit_all.append(h2[keep].cpu())
                valid_all.append((v2 & reached(h2))[keep].cpu())
            else:
                anchors = sample_anchors(plen, lens, gamma, anchors_per_seq, gen)
                out = drafter.train_forward(shared, feats, tokens, anchors)
                hit = out["logits"].argmax(-1) == out["labels"]
                logits_all.append(out["confidence"].float().reshape(-1, gamma).cpu())
                hit_all.append(hit.reshape(-1, gamma).cpu())
                valid_all.append(reached(hit).reshape(-1, gamma).cpu())
    return torch.cat(logits_all), torch.cat(hit_all).float(), torch.cat(valid_all).bool()
