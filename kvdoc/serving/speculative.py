"""Speculative decoding: a draft model proposes ``k`` tokens, the target checks them in one call.

Each round, the draft feeds the *pending* token (the last, fed to neither model yet) and
proposes ``d_1 .. d_k``; the target feeds ``[pending, d_1, .., d_k]`` as one chunk; proposals
are kept while they agree with the target (greedy: its argmax; sampling: :func:`acceptance`),
the first disagreement replaced by the target's token (all agree: its next one is a bonus); both
caches are cropped back to what was kept. A round costs one target call and yields 1 to
``k + 1`` of the target's own tokens: token for token when greedy, in distribution when sampling
(Leviathan et al. 2023, Chen et al. 2023). Batch 1 only; the caches must crop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from kvdoc.core.cache import KVCache, check_int
from kvdoc.core.model import Decoder


@dataclass
class SpeculativeRun:
    """What :func:`speculative_generate` returns: ``tokens``, the proposals ``accepted`` each
    round, each model's calls and its cache as the last round left it."""

    tokens: torch.Tensor
    prompt_len: int
    accepted: list[int] = field(default_factory=list)
    target_calls: int = 0
    draft_calls: int = 0
    target_cache: KVCache | None = None
    draft_cache: KVCache | None = None

    @property
    def rounds(self) -> int:
        """Verify calls of the target: one per round."""
        return len(self.accepted)


Rule = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""An acceptance rule: the target's and the draft's probabilities ``[V]`` of one position ->
the probability of keeping each proposed token, and the distribution a rejection redraws from."""


def acceptance(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A token ``x`` drawn from the draft's ``q`` is kept with probability ``min(1, p(x) /
    q(x))``, else replaced by a draw from ``max(0, p - q)``, normalised: distributed as ``p``.

    >>> p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.2, 0.6])
    >>> keep, residual = acceptance(p, q)
    >>> reject = 1 - (q * keep).sum()
    >>> torch.allclose(q * keep + reject * residual, p)
    True
    """
    keep = torch.where(q > 0, (p / q).clamp(max=1.0), torch.zeros_like(p))
    excess = (p - q).clamp(min=0.0)
    total = excess.sum()
    residual = excess / total if total > 0 else p  # p == q: nothing is ever rejected
    return keep, residual


def truncated_draft(target: Decoder, n_layer: int) -> Decoder:
    """A draft of the target's first ``n_layer`` layers, final norm and LM head (LayerSkip's
    self-speculative draft).

    >>> from kvdoc import GPTConfig
    >>> draft = truncated_draft(Decoder(GPTConfig()), 1)
    >>> draft.config.n_layer, draft.num_parameters() < Decoder(GPTConfig()).num_parameters()
    (1, True)
    """
    layers = target.config.n_layer
    if check_int("n_layer", n_layer) > layers:
        raise ValueError(f"n_layer must be between 1 and {layers}, got {n_layer!r}")
    weight = target.wte.weight
    draft = type(target)(replace(target.config, n_layer=n_layer)).to(weight.dtype)  # MLA too
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in draft.state_dict()})
    return draft.to(weight.device).eval()


def _checked(cache: KVCache) -> KVCache:
    if not isinstance(cache, KVCache):
        raise ValueError(f"the cache function must return a KVCache, got {type(cache).__name__}")
    if cache.seq_len:
        raise ValueError("speculative decoding starts from empty caches; "
                         f"one holds {cache.seq_len} positions")
    if not cache.keeps_every_position:
        raise ValueError(f"speculative decoding rolls back rejected tokens, and a "
                         f"{type(cache).__name__} cannot crop; use a dynamic or static cache")
    return cache


def _sync(model: Decoder, cache: KVCache, tokens: torch.Tensor) -> tuple[KVCache, int]:
    """Crop ``cache`` to the kept positions and feed what it lacks, all but the pending token."""
    keep = tokens.shape[1] - 1
    if cache.seq_len > keep:
        cache = cache.crop(keep)
    if cache.seq_len == keep:
        return cache, 0
    return model(tokens[:, cache.seq_len:keep], cache)[1], 1  # the draft's own last proposal


@torch.no_grad()
def speculative_generate(target: Decoder, draft: Decoder, prompt: torch.Tensor,
                         max_new_tokens: int, k: int = 4, *,
                         cache: str | Callable[[Decoder, int], KVCache] = "dynamic",
                         generator: torch.Generator | None = None,
                         rule: Rule | None = None) -> SpeculativeRun:
    """``max_new_tokens`` tokens after ``prompt`` (``[1, P]``), the draft proposing ``k`` a round.

    ``cache``: the kind both models use, or ``(model, capacity) -> empty cache`` (one that
    crops); ``generator``: sample by ``rule`` (default :func:`acceptance`), else greedy: token
    for token ``generate(target, prompt, max_new_tokens)``.

    >>> from kvdoc import GPTConfig, generate
    >>> _ = torch.manual_seed(0)
    >>> target, draft = Decoder(GPTConfig()).eval(), Decoder(GPTConfig(n_layer=1)).eval()
    >>> prompt = torch.tensor([[5, 6, 7]])
    >>> run = speculative_generate(target, draft, prompt, 12, k=3)
    >>> torch.equal(run.tokens, generate(target, prompt, 12))
    True
    """
    check_int("k", k)
    check_int("max_new_tokens", max_new_tokens)
    target.check_input(prompt, None)
    if prompt.shape[0] != 1:
        raise ValueError(f"speculative decoding here takes one sequence, "
                         f"got batch {prompt.shape[0]}")
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"target and draft vocabularies differ: {target.config.vocab_size} "
                         f"and {draft.config.vocab_size}")
    total = prompt.shape[1] + max_new_tokens
    # the target's verify call reaches k positions past the last kept token
    for who, model in (("target", target), ("draft", draft)):
        if total + k > model.config.n_positions:
            raise ValueError(f"prompt of {prompt.shape[1]} + {max_new_tokens} new tokens + {k} "
                             f"proposals exceed the {who}'s {model.config.n_positions} positions")
    make = cache if callable(cache) else (
        lambda model, capacity: model.new_cache(1, cache, capacity=capacity))
    t_cache, d_cache = (_checked(make(model, total + k)) for model in (target, draft))
    run = SpeculativeRun(prompt, prompt.shape[1])

    def pick(logits: torch.Tensor) -> torch.Tensor:  # [1, V] -> [1, 1]
        if generator is None:
            return logits.argmax(dim=-1, keepdim=True)
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)

    # the prompt, all but its last token, fills both caches; the last token is pending
    tokens = prompt
    if prompt.shape[1] > 1:
        _, t_cache = target(prompt[:, :-1], t_cache)
        _, d_cache = draft(prompt[:, :-1], d_cache)
        run.target_calls, run.draft_calls = 1, 1
    while tokens.shape[1] < total:
        want = total - tokens.shape[1]  # tokens still to produce; a round gives at most k + 1
        steps = min(k, want - 1) if want > 1 else 0
        proposals, q_probs = [], []
        token = tokens[:, -1:]
        for _ in range(steps):
            logits, d_cache = draft(token, d_cache)
            run.draft_calls += 1
            q_probs.append(logits[0, -1].softmax(dim=-1))
            token = pick(logits[:, -1])
            proposals.append(token)
        chunk = torch.cat([tokens[:, -1:], *proposals], dim=1)  # [1, steps + 1]
        logits, t_cache = target(chunk, t_cache)  # logits[:, i] predicts the token after chunk[i]
        run.target_calls += 1
        kept = []
        for i, proposal in enumerate(proposals):
            if generator is None:
                ok = bool(proposal.item() == logits[0, i].argmax().item())
            else:
                keep, residual = (rule or acceptance)(logits[0, i].softmax(dim=-1), q_probs[i])
                ok = bool(torch.rand(1, generator=generator).item() < keep[proposal.item()].item())
            if not ok:
                break
            kept.append(proposal)
        a = len(kept)
        if a < len(proposals) and generator is not None:
            last = torch.multinomial(residual, 1, generator=generator).view(1, 1)
        else:
            last = pick(logits[:, a])  # the target's token after the last kept one
        run.accepted.append(a)
        tokens = torch.cat([tokens, *kept, last], dim=1)
        t_cache, _ = _sync(target, t_cache, tokens)
        d_cache, calls = _sync(draft, d_cache, tokens)
        run.draft_calls += calls
    run.tokens, run.target_cache, run.draft_cache = tokens, t_cache, d_cache
    return run
