"""Speculative decoding gives the target's own greedy tokens, whatever the draft proposes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvdoc import Decoder, GPTConfig, generate, llama_config, mistral_config
from kvdoc.serving.speculative import acceptance, speculative_generate

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
