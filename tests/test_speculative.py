"""Speculative decoding gives the target's own greedy tokens, whatever the draft proposes, and
under sampling one round's tokens are distributed exactly as the target's."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kvdoc import Decoder, GPTConfig, generate, llama_config, mistral_config
from kvdoc.proofs.compare import default_model
from kvdoc.serving.speculative import Rule, acceptance, speculative_generate

CONFIGS = {"gpt2": GPTConfig(), "gqa": GPTConfig(n_kv_head=2), "llama": llama_config(),
           "mistral": mistral_config(sliding_window=8)}


def model(config: GPTConfig, seed: int) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(config).double().eval()  # FP64: no argmax near-tie between call shapes


class WrongDraft(Decoder):
    """The target's weights with negated logits: it proposes the target's least likely token."""

    def forward(self, idx, cache=None, **kwargs):
        out = super().forward(idx, cache, **kwargs)
        return out._replace(logits=-out.logits)  # its argmax is the least likely token


# every model with both cache kinds; k of 1, 3 and 7; prompts of 1 and 5 tokens
@pytest.mark.parametrize("name, kind, k, prompt_len", [
    ("gpt2", "dynamic", 1, 5), ("gpt2", "static", 3, 1), ("gqa", "dynamic", 7, 1),
    ("gqa", "static", 1, 5), ("llama", "dynamic", 3, 5), ("llama", "static", 7, 5),
    ("mistral", "dynamic", 7, 5), ("mistral", "static", 3, 1)])
def test_greedy_output_is_the_targets(name, kind, k, prompt_len):
    config = CONFIGS[name]
    target = model(config, 0)
    draft = model(dataclasses.replace(config, n_layer=1), 1)
    prompt = torch.arange(3, 3 + prompt_len)[None]
    run = speculative_generate(target, draft, prompt, 17, k=k, cache=kind)
    assert torch.equal(run.tokens, generate(target, prompt, 17))
    assert run.tokens.shape[1] - prompt_len == sum(run.accepted) + run.rounds
    assert all(0 <= a <= k for a in run.accepted)


def test_any_cache_that_crops_serves_both_models():
    from kvdoc.serving.paged import new_paged_cache

    torch.manual_seed(0)
    target, draft = Decoder(GPTConfig()).eval(), Decoder(GPTConfig(n_layer=1)).eval()
    prompt = torch.tensor([[5, 6, 7]])
    made = []

    def paged(model, capacity):
        made.append(model)
        return new_paged_cache(model, 1, capacity)

    run = speculative_generate(target, draft, prompt, 12, k=3, cache=paged)
    assert torch.equal(run.tokens, generate(target, prompt, 12))
    assert made == [target, draft] and sum(run.accepted) + run.rounds == 12


def test_a_perfect_draft_has_every_proposal_accepted():
    target = model(GPTConfig(), 0)
    run = speculative_generate(target, target, torch.tensor([[1, 2, 3]]), 21, k=4)
    assert run.accepted == [4, 4, 4, 4, 0]  # 5 + 5 + 5 + 5 + 1 = 21 tokens in 5 rounds
    assert torch.equal(run.tokens, generate(target, torch.tensor([[1, 2, 3]]), 21))


def test_a_draft_that_is_always_wrong_costs_one_target_call_per_token():
    torch.manual_seed(0)
    target = model(GPTConfig(), 0)
    draft = WrongDraft(GPTConfig()).double().eval()
    draft.load_state_dict(target.state_dict())
    prompt = torch.tensor([[1, 2, 3]])
    run = speculative_generate(target, draft, prompt, 10, k=3)
    assert run.accepted == [0] * 10
    assert torch.equal(run.tokens, generate(target, prompt, 10))


def test_sampling_keeps_lengths_and_ids():
    target, draft = model(GPTConfig(), 0), model(GPTConfig(n_layer=1), 1)
    run = speculative_generate(target, draft, torch.tensor([[4, 5]]), 15, k=3,
                               generator=torch.Generator().manual_seed(0))
    assert run.tokens.shape == (1, 17)
    assert 0 <= int(run.tokens.min()) and int(run.tokens.max()) < 97


@pytest.mark.parametrize("seed", range(5))
def test_the_acceptance_rule_samples_the_target(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(11, generator=g, dtype=torch.float64).softmax(0)
    q = (torch.rand(11, generator=g, dtype=torch.float64) * 3).softmax(0)
    q[3] = 0.0  # a token the draft never proposes must still come out with p's probability
    q = q / q.sum()
    keep, residual = acceptance(p, q)
    reject = 1 - (q * keep).sum()
    torch.testing.assert_close(q * keep + reject * residual, p, atol=1e-12, rtol=1e-12)


def test_an_equal_draft_is_never_rejected():
    p = torch.tensor([0.25, 0.75], dtype=torch.float64)
    keep, _ = acceptance(p, p.clone())
    assert torch.equal(keep, torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=torch.tensor([[1, 2], [3, 4]])), "one sequence, got batch 2"),
    (dict(k=0), "k must be a positive integer"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(draft=Decoder(GPTConfig(vocab_size=50))), "vocabularies differ: 97 and 50"),
    (dict(max_new_tokens=510), "exceed the target's 512 positions"),
    (dict(cache="window", target=Decoder(mistral_config(sliding_window=8)),
          draft=Decoder(mistral_config(sliding_window=8))), "cannot crop"),
    (dict(cache=lambda model, capacity: "dynamic"), "must return a KVCache, got str"),
    (dict(cache=lambda model, capacity: model(torch.tensor([[1]]), model.new_cache(1)).cache),
     "starts from empty caches; one holds 1 positions"),
])
def test_bad_input_is_refused(kwargs, message):
    args = dict(target=Decoder(GPTConfig()), draft=Decoder(GPTConfig(n_layer=1)),
                prompt=torch.tensor([[1, 2]]), max_new_tokens=4, k=2)
    with pytest.raises(ValueError, match=message):
        speculative_generate(**{**args, **kwargs})


# --- one round of speculative sampling, enumerated exactly ------------------------------------
# On a vocabulary small enough to enumerate, the model's next-token distribution over its first
# ``V`` ids is the target, the same at temperature 2 the draft. Every draft of ``k`` tokens,
# every accept-or-reject outcome and every redraw is enumerated with its probability, the round's
# tokens are extended to ``k + 1`` with the target's own conditionals, and the result must be the
# target's joint distribution of ``k + 1`` tokens: exactly, up to FP64 rounding (the enumeration
# runs in FP64 whatever the model's dtype), not a statistical test. A wrong rule still gives
# plausible tokens: only this sees it.

Table = dict[tuple[int, ...], list[float]]  # next-token probabilities by the tokens so far
EXACT = 1e-12


@torch.no_grad()
def tables(model: Decoder, prompt: tuple[int, ...], vocab: int, depth: int,
           temperature: float = 1.0) -> Table:
    """The model's next-token distribution over ids ``0 .. vocab - 1`` (renormalised, FP64)
    after ``prompt`` followed by every sequence of those ids of length ``0 .. depth``."""
    device, out = model.wte.weight.device, {}
    for n in range(depth + 1):
        tails = list(itertools.product(range(vocab), repeat=n))
        ids = torch.tensor([prompt + t for t in tails], device=device)
        logits = model(ids, last_only=True).logits[:, -1, :vocab].double() / temperature
        out.update(zip(tails, logits.softmax(dim=-1).cpu().tolist(), strict=True))
    return out


def target_distribution(p: Table, vocab: int, n: int) -> torch.Tensor:
    """``[vocab] * n``: the target's probability of each sequence of ``n`` tokens."""
    out = []
    for seq in itertools.product(range(vocab), repeat=n):  # in row-major order
        w = 1.0
        for i, x in enumerate(seq):
            w *= p[seq[:i]][x]
        out.append(w)
    return torch.tensor(out, dtype=torch.float64).view([vocab] * n)


def round_distribution(p: Table, q: Table, vocab: int, k: int,
                       rule: Rule = acceptance) -> torch.Tensor:
    """``[vocab] * (k + 1)``: the probability of each ``k + 1`` tokens after one round under
    ``rule`` (draft ``q`` proposes ``k``; the first rejection is redrawn from the rule's
    residual, or all are kept and the target adds one), extended with the target's
    conditionals."""
    out = dict.fromkeys(itertools.product(range(vocab), repeat=k + 1), 0.0)
    rules = {ctx: [t.tolist() for t in rule(torch.tensor(p[ctx], dtype=torch.float64),
                                            torch.tensor(q[ctx], dtype=torch.float64))]
             for ctx in q}

    def emit(seq: tuple[int, ...], w: float) -> None:  # extend with the target's conditionals
        if len(seq) == k + 1:
            out[seq] += w
            return
        for x in range(vocab):
            emit(seq + (x,), w * p[seq][x])

    for draft in itertools.product(range(vocab), repeat=k):
        alive = 1.0  # the probability of drawing this draft and keeping it so far
        for i in range(k):
            alive *= q[draft[:i]][draft[i]]
        for i in range(k):
            keep, residual = rules[draft[:i]]
            for x in range(vocab):  # rejected at i: the residual draw
                emit(draft[:i] + (x,), alive * (1 - keep[draft[i]]) * residual[x])
            alive *= keep[draft[i]]
        for x in range(vocab):  # every proposal kept: the target's bonus token
            emit(draft + (x,), alive * p[draft][x])
    return torch.tensor(list(out.values()), dtype=torch.float64).view([vocab] * (k + 1))


def speculative_distribution_error(model: Decoder, rule: Rule = acceptance, vocab: int = 4,
                                   k: int = 2, prompt: tuple[int, ...] = (5, 6, 7)
                                   ) -> tuple[float, float]:
    """``(largest difference of one round's distribution from the target's, smallest
    probability a round rejects with)`` on ``model``'s first ``vocab`` ids after ``prompt``: a
    check in which nothing is rejected would not reach the residual."""
    p = tables(model, prompt, vocab, k)
    q = tables(model, prompt, vocab, k - 1, temperature=2.0)
    got = round_distribution(p, q, vocab, k, rule)
    want = target_distribution(p, vocab, k + 1)
    rejection = min(1 - sum(min(a, b) for a, b in zip(p[ctx], q[ctx], strict=True))
                    for ctx in q)
    return float((got - want).abs().max()), rejection


def speculative_sampling_exact(model: Decoder, rule: Rule = acceptance) -> bool:
    error, rejection = speculative_distribution_error(model, rule)
    return error <= EXACT and rejection > 0


def residual_is_target(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BROKEN: :func:`~kvdoc.serving.speculative.acceptance`, but a rejected proposal is redrawn
    from ``p`` itself, not from ``max(0, p - q)`` normalised."""
    keep, _ = acceptance(p, q)
    return keep, p  # BUG: the residual is the target


# vocabulary 2, one proposal: the draft prefers token 0 (0.9), the target is even; the
# second token's conditionals are made up, different after 0 and after 1
P = {(): [0.5, 0.5], (0,): [0.2, 0.8], (1,): [0.7, 0.3]}
Q = {(): [0.9, 0.1]}


def test_round_distribution_by_hand():
    exact = round_distribution(P, Q, vocab=2, k=1)
    assert torch.allclose(exact, target_distribution(P, 2, 2), atol=1e-15, rtol=0)
    assert torch.allclose(exact.sum(1), torch.tensor([0.5, 0.5], dtype=torch.float64))
    # kept: 0.9 * 5/9 = 0.5 of token 0; rejected 0.4, redrawn from p itself: 0.2 more of it
    broken_first = round_distribution(P, Q, 2, 1, residual_is_target).sum(1)
    assert torch.allclose(broken_first, torch.tensor([0.7, 0.3], dtype=torch.float64))


def test_speculative_distribution_exact_and_broken_residual_caught():
    model = default_model()
    error, rejection = speculative_distribution_error(model)
    assert error <= EXACT and rejection > 0
    assert not speculative_sampling_exact(model, residual_is_target)
