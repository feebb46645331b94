"""The reference speculative loop: greedy output equals the target's own greedy decoding; sampling
verification preserves the target distribution (chi-square on a tiny vocabulary)."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from kllm_plugins.plugins.dspark.core.draft_runtime import DraftOut, make_runner
from kllm_plugins.plugins.dspark.core.drafters import DrafterConfig, SharedTarget, build_drafter
from kllm_plugins.plugins.dspark.core.spec_loop import autoregressive_generate, speculative_generate
from kllm_plugins.plugins.dspark.core.target_llama import LlamaShape, LlamaTarget


def random_target(vocab: int, seed: int, dtype: torch.dtype = torch.float64, layers: int = 2,
                  head_scale: float = 0.5) -> LlamaTarget:
    shape = LlamaShape(vocab_size=vocab, hidden_size=32, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=48, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, 32, generator=g),
        "model.norm.weight": torch.ones(32),
        "lm_head.weight": torch.randn(vocab, 32, generator=g) * head_scale,
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": torch.ones(32), p + "post_attention_layernorm.weight": torch.ones(32),
            p + "self_attn.q_proj.weight": torch.randn(32, 32, generator=g) * 0.3,
            p + "self_attn.k_proj.weight": torch.randn(16, 32, generator=g) * 0.3,
            p + "self_attn.v_proj.weight": torch.randn(16, 32, generator=g) * 0.3,
            p + "self_attn.o_proj.weight": torch.randn(32, 32, generator=g) * 0.3,
            p + "mlp.gate_proj.weight": torch.randn(48, 32, generator=g) * 0.3,
            p + "mlp.up_proj.weight": torch.randn(48, 32, generator=g) * 0.3,
            p + "mlp.down_proj.weight": torch.randn(32, 48, generator=g) * 0.3,
        })
    return LlamaTarget(shape, state, device="cpu", dtype=dtype)


def drafter_for(target: LlamaTarget, kind: str, gamma: int, head: str = "vanilla", seed: int = 0,
                layers: tuple[int, ...] | None = None) -> torch.nn.Module:
    torch.manual_seed(seed)
    s = target.shape
    cfg = DrafterConfig(kind=kind, vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_layers=1, num_heads=4,
                        num_kv_heads=2, head_dim=8, intermediate_size=32, block_size=gamma, target_layer_ids=layers or tuple(range(s.num_layers)),
                        mask_token_id=1, markov_rank=8 if kind == "dspark" else 0, markov_head_type=head)
    model = build_drafter(cfg).to(target.dtype).eval()
    with torch.no_grad():  # a random Markov head with weight, so drafts depend on the previous token
        for n, p in model.named_parameters():
            if "markov_w2" in n:
                p.normal_(0, 1.0)
    return model


class NoisyOracle:
    """Proposes the reference greedy continuation, each token corrupted with probability 0.35."""

    def __init__(self, ref: list[list[int]], plens: list[int], gamma: int, vocab: int, seed: int) -> None:
        self.ref, self.plens, self.gamma, self.vocab = ref, plens, gamma, vocab
        self.g = torch.Generator().manual_seed(seed)
        self.lens = torch.zeros(len(ref), dtype=torch.long)

    def observe(self, feats, start, n_keep, tokens, bonus) -> None:  # noqa: ANN001
        self.lens = (start + n_keep).cpu()

    def propose(self, bonus, temperature=0.0, generator=None) -> DraftOut:  # noqa: ANN001
        out = torch.zeros(len(self.ref), self.gamma, dtype=torch.long)
        for b, ref in enumerate(self.ref):
            for k in range(self.gamma):
                i = int(self.lens[b]) + 1 + k - self.plens[b]
                good = ref[i] if i < len(ref) else 0
                bad = int(torch.randint(0, self.vocab, (1,), generator=self.g))
                out[b, k] = good if float(torch.rand(1, generator=self.g)) > 0.35 else bad
        return DraftOut(out, None, torch.zeros(len(self.ref), self.gamma))


PROMPTS = [[3, 7, 2, 9, 4], [5, 1], [8, 8, 8, 2, 6, 1, 3, 3], [2, 4, 6]]


def chisquare_pvalue(observed: list[float], expected: list[float]) -> float:
    """Pearson chi-square goodness of fit, p = Q(df/2, x/2) (regularised upper incomplete gamma)."""
    obs = torch.tensor(observed, dtype=torch.float64)
    exp = torch.tensor(expected, dtype=torch.float64)
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("verify_len", [None, 1, 3])
def test_greedy_equals_target_greedy_with_partial_acceptance(verify_len: int | None) -> None:
    target = random_target(64, seed=0)
    gamma, new = 4, 30
    ref = autoregressive_generate(target, PROMPTS, max_new_tokens=new + gamma + 2)
    oracle = NoisyOracle(ref.outputs, [len(p) for p in PROMPTS], gamma, 64, seed=1)
    res = speculative_generate(target, lambda b, m: oracle, PROMPTS, gamma=gamma, max_new_tokens=new,
                               capture_layers=[0], verify_len=verify_len)
    assert res.outputs == [o[:new] for o in ref.outputs]
    acc = torch.cat([r.accepted for r in res.records])
    length = gamma + 1 if verify_len is None else verify_len
    assert int(acc.max()) <= length - 1
    if length > 2:  # both full acceptance and early rejection happened, so commits were ragged
        assert int(acc.min()) == 0 and int(acc.max()) >= 2
    assert res.steps < new  # fewer target steps than tokens
    assert res.verify_tokens() == sum(length * r.accepted.numel() for r in res.records)


@pytest.mark.parametrize("kind,head", [("dspark", "vanilla"), ("dspark", "gated"), ("dspark", "rnn"),
                                       ("dflash", "vanilla"), ("eagle", "vanilla")])
def test_greedy_equals_target_greedy_with_trainable_drafters(kind: str, head: str) -> None:
    target = random_target(16, seed=3)  # small vocab: random drafters get some tokens right
    model = drafter_for(target, kind, gamma=3, head=head)
    shared = SharedTarget(target.embed, target.lm_head)
    ref = autoregressive_generate(target, PROMPTS, max_new_tokens=25)
    res = speculative_generate(target, lambda b, m: make_runner(model, shared, b, m), PROMPTS, gamma=3,
                               max_new_tokens=25, capture_layers=[0, 1])
    assert res.outputs == ref.outputs
    assert res.accept_lengths().numel() > 0


def test_eos_stops_a_row() -> None:
    target = random_target(64, seed=0)
    ref = autoregressive_generate(target, PROMPTS, max_new_tokens=20)
    eos = ref.outputs[0][5]
    oracle = NoisyOracle(autoregressive_generate(target, PROMPTS, max_new_tokens=40).outputs,
                         [len(p) for p in PROMPTS], 4, 64, seed=2)
    res = speculative_generate(target, lambda b, m: oracle, PROMPTS, gamma=4, max_new_tokens=20,
                               capture_layers=[0], eos_id=eos)
    assert res.outputs[0] == ref.outputs[0][: ref.outputs[0].index(eos) + 1]


def _exact_distribution(target: LlamaTarget, prompt: list[int], n: int, temperature: float) -> dict[tuple, float]:
    vocab = target.shape.vocab_size
    seqs = list(itertools.product(range(vocab), repeat=n))
    x = torch.tensor([prompt + list(s) for s in seqs])
    logits, _ = target.full_forward(x)
    lp = torch.log_softmax(logits / temperature, dim=-1)
    total = torch.zeros(len(seqs), dtype=torch.float64)
    for i in range(n):
        pos = len(prompt) - 1 + i
        total += lp[torch.arange(len(seqs)), pos, x[:, pos + 1]]
    probs = total.exp()
    probs = probs / probs.sum()  # rows sharing a prefix differ in the last bits
    return {s: float(p) for s, p in zip(seqs, probs)}


@pytest.mark.parametrize("kind", ["dspark", "eagle", "greedy_drafts"])
def test_sampling_verification_preserves_target_distribution(kind: str) -> None:
    vocab, n, temperature, samples = 4, 3, 1.0, 12000
    target = random_target(vocab, seed=5, layers=1, head_scale=0.15)
    prompt = [1, 2, 3]
    exact = _exact_distribution(target, prompt, n, temperature)
    model = drafter_for(target, "dspark" if kind != "eagle" else "eagle", gamma=2, seed=4)
    shared = SharedTarget(target.embed, target.lm_head)
    gen = torch.Generator().manual_seed(11)

    def runner(b: int, m: int):
        r = make_runner(model, shared, b, m)
        if kind == "greedy_drafts":  # drafts drawn greedily (one-hot q) while the target samples
            orig = r.propose
            r.propose = lambda bonus, t=0.0, g=None: orig(bonus, 0.0, g)  # type: ignore[method-assign]
        return r

    res = speculative_generate(target, runner, [prompt] * samples, gamma=2, max_new_tokens=n, capture_layers=[0],
                               temperature=temperature, generator=gen)
    counts: dict[tuple, int] = {s: 0 for s in exact}
    for o in res.outputs:
        counts[tuple(o)] += 1
    keys = sorted(exact)
    f_obs = torch.tensor([counts[k] for k in keys], dtype=torch.float64)
    f_exp = torch.tensor([exact[k] for k in keys], dtype=torch.float64) * samples
    # pool rare outcomes so every expected count is >= 5
    order = torch.argsort(f_exp)
    obs, exp, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order.tolist():
        acc_o += float(f_obs[i])
        acc_e += float(f_exp[i])
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o = acc_e = 0.0
    exp[-1] += acc_e
    obs[-1] += acc_o
    p = chisquare_pvalue(obs, exp)
    assert p > 1e-3, f"chi-square p={p}"
    # the drafter did get tokens accepted, so verification (not only resampling) was exercised
    assert float(res.accept_lengths().mean()) > 1.2


def test_sampling_check_detects_a_biased_verifier() -> None:
    """The chi-square check above can fail: accepting every draft (no rejection) is caught."""
    from kllm_plugins.plugins.dspark.core import spec_loop

    vocab, n, samples = 4, 3, 12000
    target = random_target(vocab, seed=5, layers=1, head_scale=0.15)
    prompt = [1, 2, 3]
    exact = _exact_distribution(target, prompt, n, 1.0)
    model = drafter_for(target, "dspark", gamma=2, seed=4)
    shared = SharedTarget(target.embed, target.lm_head)
    orig = spec_loop.verify

    def accept_all(draft, logits, temperature, generator):  # noqa: ANN001
        b, length, _ = logits.shape
        n_acc = torch.full((b,), length - 1, dtype=torch.long)
        nxt = torch.multinomial(torch.softmax(logits[:, -1], -1), 1, generator=generator).squeeze(-1)
        return n_acc, nxt

    spec_loop.verify = accept_all
    try:
        res = speculative_generate(target, lambda b, m: make_runner(model, shared, b, m), [prompt] * samples, gamma=2,
                                   max_new_tokens=n, capture_layers=[0], temperature=1.0,
                                   generator=torch.Generator().manual_seed(11))
    finally:
        spec_loop.verify = orig
    keys = sorted(exact)
    counts = {k: 0 for k in keys}
    for o in res.outputs:
        counts[tuple(o)] += 1
    big = [k for k in keys if exact[k] * samples >= 5]
    obs = [counts[k] for k in big] + [samples - sum(counts[k] for k in big)]
    exp = [exact[k] * samples for k in big] + [samples - sum(exact[k] * samples for k in big)]
    assert chisquare_pvalue(obs, exp) < 1e-3
