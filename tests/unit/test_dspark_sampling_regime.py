"""Run 7's regime (drafters for sampling): answers sampled at a temperature with a seeded generator,
the target's final hidden state in the feature cache, the distribution loss w_ce CE + w_tv TV and its
confidence target 1 - TV, for the three drafter kinds."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kllm_plugins.plugins.dspark.core.draft_runtime import DraftOut
from kllm_plugins.plugins.dspark.core.drafters import SharedTarget, build_drafter
from kllm_plugins.plugins.dspark.core.spec_loop import autoregressive_generate, verify
from kllm_plugins.plugins.dspark.training.data import (answers_meta, generate_answers, load_answers_for, pad_batch,
                                                       save_answers)
from kllm_plugins.plugins.dspark.training.dist_loss import (block_dist_losses, reach_probability, tv_distance)
from kllm_plugins.plugins.dspark.training.feature_cache import FeatureCache
from kllm_plugins.plugins.dspark.training.trainer import TrainConfig, drafter_step, train_drafter
from kllm_plugins.plugins.dspark.training.walk_eval import expected_accept_length, expected_accepts

sys.path.insert(0, str(Path(__file__).parent))
from test_dspark_spec_loop import chisquare_pvalue, drafter_for, random_target  # noqa: E402


def test_sampled_answers_follow_the_tempered_target_and_are_reproducible() -> None:
    target = random_target(8, seed=11, head_scale=2.0)
    prompt = [3, 1, 4, 1, 5]
    greedy = generate_answers(target, [prompt] * 3, max_new_tokens=6, eos_id=None, batch_size=2)  # type: ignore[arg-type]
    ref = autoregressive_generate(target, [prompt], max_new_tokens=6).outputs[0]
    assert all(s == (prompt + ref, len(prompt)) for s in greedy)  # the default stays greedy
    a = generate_answers(target, [prompt] * 40, max_new_tokens=6, eos_id=None, temperature=0.7, seed=3)  # type: ignore[arg-type]
    b = generate_answers(target, [prompt] * 40, max_new_tokens=6, eos_id=None, temperature=0.7, seed=3)  # type: ignore[arg-type]
    c = generate_answers(target, [prompt] * 40, max_new_tokens=6, eos_id=None, temperature=0.7, seed=4)  # type: ignore[arg-type]
    assert a == b and a != c
    assert sum(s != greedy[0][0] for s, _ in a) > 10
    # the first answer token is distributed as softmax(logits / 0.7), not as softmax(logits)
    n = 4000
    first = [s[len(prompt)] for s, _ in generate_answers(target, [prompt] * n, max_new_tokens=1, eos_id=None,  # type: ignore[arg-type]
                                                          batch_size=1000, temperature=0.7, seed=0)]
    logits, _ = target.full_forward(torch.tensor([prompt]))
    counts = [first.count(v) for v in range(8)]
    p07 = torch.softmax(logits[0, -1] / 0.7, -1).tolist()
    p10 = torch.softmax(logits[0, -1], -1).tolist()
    assert chisquare_pvalue(counts, [n * q for q in p07]) > 1e-3
    assert chisquare_pvalue(counts, [n * q for q in p10]) < 1e-6
    with pytest.raises(ValueError, match="temperature"):
        generate_answers(target, [prompt], max_new_tokens=1, eos_id=0, temperature=-1.0)


def test_answer_files_carry_their_temperature(tmp_path: Path) -> None:
    prompts = {"train": [[1, 2], [3]], "test": [[4, 5, 6]]}
    splits = {k: [(p + [9, 9], len(p)) for p in v] for k, v in prompts.items()}
    save_answers(tmp_path / "g.xz", splits)
    save_answers(tmp_path / "s.xz", splits, meta={"train_temperature": 0.7, "seed": 1000})
    assert answers_meta(tmp_path / "g.xz") == {"train_temperature": 0.0}  # runs 5/6's files: greedy
    assert answers_meta(tmp_path / "s.xz") == {"train_temperature": 0.7, "seed": 1000.0}
    assert load_answers_for(tmp_path / "s.xz", prompts) == splits == load_answers_for(tmp_path / "g.xz", prompts)


@pytest.mark.parametrize("layers", [[0], [0, 1]])  # the last layer captured for the drafter too, or not
def test_feature_cache_keeps_the_lm_head_input_at_answer_positions(layers: list[int]) -> None:
    target = random_target(50, seed=4)
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, 50, (int(n),), generator=g).tolist(), p) for n, p in ((12, 3), (5, 5), (20, 7), (9, 1))]
    cache = FeatureCache(target, seqs, layers, max_batch_tokens=30, final_hidden=True)
    assert cache.final is not None and cache.final.shape[0] == sum(len(s) - p for s, p in seqs)  # answer tokens only
    plain = FeatureCache(target, seqs, layers, max_batch_tokens=30)
    assert plain.final is None
    with pytest.raises(ValueError, match="final_hidden"):
        plain.final_batch([0])
    shared = FeatureCache.from_shared(cache.share())
    for index in ([0, 1, 2], [3, 2], [1]):
        tokens, plen, lens, feats = cache.batch(index)
        assert torch.equal(feats, plain.batch(index)[3])  # the drafter's features are unchanged
        fin = shared.final_batch(index)
        ref_tokens, _, _ = pad_batch([seqs[i] for i in index], 0, target.device)
        ref_logits, _ = target.full_forward(ref_tokens)
        for row, (p, n) in enumerate(zip(plen.tolist(), lens.tolist())):
            assert torch.allclose((fin[row, p:n] @ target.lm_head.T).float(), ref_logits[row, p:n], atol=1e-5)
            assert not fin[row, :p].any() and not fin[row, n:].any()


def test_one_minus_tv_is_the_acceptance_probability_of_the_loops_verifier() -> None:
    g = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(6, generator=g) * 2, torch.randn(6, generator=g) * 2
    p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
    tv = tv_distance(p_logits, q_logits)
    assert torch.allclose(tv, 0.5 * (p - q).abs().sum()) and float(tv_distance(p_logits, p_logits + 3.0)) < 1e-6
    n = 20000
    d = torch.multinomial(q.expand(n, 6), 1, generator=g)  # one drafted position, drawn from q
    draft = DraftOut(d, q.expand(n, 1, 6), torch.zeros(n, 1))
    logits = p_logits.log_softmax(-1).expand(n, 2, 6)
    accepted, _ = verify(draft, logits, 1.0, g)
    assert abs(float(accepted.float().mean()) - float(1 - tv)) < 0.015


def test_block_dist_loss_weights_and_confidence_target() -> None:
    g = torch.Generator().manual_seed(1)
    b, n, gam, v = 2, 3, 4, 10
    tl = torch.randn(b, n, gam, v, generator=g)
    labels = torch.randint(0, v, (b, n, gam), generator=g)
    conf = torch.zeros(b, n, gam, requires_grad=True)
    same = {"logits": tl.clone().requires_grad_(), "labels": labels, "confidence": conf}
    loss, conf_loss, info = block_dist_losses(same, tl, 4.0, 0.0, 1.0)
    assert float(loss.detach()) < 1e-6 and float(info["p_accept_k1"]) > 1 - 1e-6  # q = p: every draft accepted
    assert abs(float(info["accept_len_t1_tf"]) - (gam + 1)) < 1e-5
    # the confidence logit 0 against a target of 1: BCE = log 2 per position
    assert abs(float(conf_loss.detach()) - float(torch.log(torch.tensor(2.0)))) < 1e-5
    other = {"logits": torch.randn(b, n, gam, v, generator=g).requires_grad_(), "labels": labels, "confidence": conf}
    loss1, _, info1 = block_dist_losses(other, tl, 4.0, 0.1, 0.9)
    w = torch.exp(-torch.arange(gam) / 4.0)
    tv = tv_distance(tl, other["logits"])
    ce = torch.nn.functional.cross_entropy(other["logits"].reshape(-1, v), labels.reshape(-1), reduction="none").view(b, n, gam)
    expect = (0.1 * (ce * w).sum() + 0.9 * (tv * w).sum()) / (w.sum() * b * n)
    assert torch.allclose(loss1, expect, atol=1e-6)
    alpha = 1 - tv.detach()
    assert torch.allclose(reach_probability(alpha)[..., 2], alpha[..., 0] * alpha[..., 1])


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle"])
def test_tv_training_moves_each_drafter_towards_the_targets_distribution(kind: str) -> None:
    target = random_target(24, seed=7, dtype=torch.float32, head_scale=1.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 24, (5,), generator=g).tolist() for _ in range(12)]
    seqs = generate_answers(target, prompts, max_new_tokens=14, eos_id=None, temperature=0.7, seed=0)  # type: ignore[arg-type]
    model = build_drafter(drafter_for(target, kind, gamma=3).cfg).float()
    cfg = TrainConfig(steps=120, batch_size=4, anchors_per_seq=4, lr=3e-3, warmup=5, log_every=10**6, w_ce=0.1, w_tv=0.9)
    with pytest.raises(ValueError, match="final_hidden"):
        train_drafter(target, model, seqs, cfg, cache=FeatureCache(target, seqs, list(model.cfg.target_layer_ids)))
    cache = FeatureCache(target, seqs, list(model.cfg.target_layer_ids), final_hidden=True)
    shared = SharedTarget(target.embed, target.lm_head)

    def tv_now() -> float:
        with torch.no_grad():
            vals = [float(drafter_step(cache, shared, model, list(range(i, i + 4)), cfg, torch.Generator().manual_seed(9))[2]["tv"])
                    for i in range(0, 12, 4)]
        return sum(vals) / len(vals)

    batches = [(*cache.batch(range(i, i + 4)), cache.final_batch(range(i, i + 4))) for i in range(0, 12, 4)]
    before, e_before = tv_now(), expected_accept_length(model, shared, batches)
    train_drafter(target, model, seqs, cfg, cache=cache)
    after, e_after = tv_now(), expected_accept_length(model, shared, batches)
    assert after < 0.9 * before, (before, after)
    # the temperature-1 validation measure rises with it (and stays within 1 .. gamma + 1)
    assert 1.0 <= e_before < e_after <= 4.0, (e_before, e_after)


def test_expected_accepts_is_the_product_of_acceptance_probabilities() -> None:
    target = random_target(16, seed=5)
    model = drafter_for(target, "dspark", gamma=3)
    shared = SharedTarget(target.embed, target.lm_head)
    g = torch.Generator().manual_seed(2)
    seqs = [(torch.randint(0, 16, (14,), generator=g).tolist(), 4), (torch.randint(0, 16, (9,), generator=g).tolist(), 3)]
    cache = FeatureCache(target, seqs, list(model.cfg.target_layer_ids), final_hidden=True)
    tokens, plen, lens, feats = cache.batch([0, 1])
    final = cache.final_batch([0, 1])
    total, count = expected_accepts(model, shared, feats, tokens, plen, lens, final, max_anchors=8, stride=1)
    ref_total, ref_count = 0.0, 0
    torch.set_grad_enabled(False)
    for row, (seq, p) in enumerate(seqs):
        for a in range(p, len(seq) - 1 - 3 + 1):  # every anchor with a whole block in the answer
            ref_count += 1
            logits_t, _ = target.full_forward(torch.tensor([seq]))
            out = model.train_forward(shared, feats[row:row + 1, :len(seq)], tokens[row:row + 1, :len(seq)],
                                      torch.tensor([[a]]))
            surv = 1.0
            for k in range(3):  # step k drafts the token at a + k + 1: the target's p is read at a + k
                pt = torch.softmax(logits_t[0, a + k].double(), -1)
                q = torch.softmax(out["logits"][0, 0, k].double(), -1)
                surv *= float(torch.minimum(pt, q).sum())
                ref_total += surv
    torch.set_grad_enabled(True)
    assert count == ref_count and abs(total - ref_total) < 1e-6
