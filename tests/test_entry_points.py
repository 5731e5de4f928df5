"""``generate_padded`` on every model of the grid, and split-K crossed with a padded batch.

The first was verify's ``generate_padded`` scenario; it never varied by cache kind (the function
makes its own dynamic cache), so it is a test here, on the same models.
"""

import pytest
import torch

from kvdoc.core.model import generate
from kvdoc.proofs import grid
from kvdoc.proofs.broken.decoders import DecodeWithoutPadMaskDecoder, copy_as, pad_leak_split_k
from kvdoc.proofs.compare import TOLERANCE, close, default_stream
from kvdoc.proofs.sweep import sweep_variants
from kvdoc.serving.batching import (
    PaddedGeneration,
    generate_padded,
    left_pad,
    padded_mask,
    padded_positions,
)

PROMPTS, NEW = (7, 3), 4
EVERY = [name for name, spec in grid.MODELS.items() if spec.scenarios is None]
"""The grid's models that run every scenario (where ``verify`` ran this one)."""


@torch.no_grad()
def padded_as_alone(model, run=generate_padded) -> bool:
    """``run``'s rows equal each prompt's solo ``generate()`` (tokens) and are within FP32's
    tolerance of one full forward (the logits behind each choice)."""
    ids = default_stream(batch=len(PROMPTS), vocab_size=model.config.vocab_size)
    prompts = [ids[b, :n].tolist() for b, n in enumerate(PROMPTS)]
    got = run(model, prompts, NEW)
    ok = tuple(got.tokens.shape) == (len(prompts), NEW)
    for b, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt]), NEW)
        full = model(alone[:, :-1]).logits[0, len(prompt) - 1:]
        ok = (ok and torch.equal(got.tokens[b], alone[0, len(prompt):])
              and close(got.logits[b], full, TOLERANCE[torch.float32]))
    return ok


@torch.no_grad()
def generate_padded_unmasked_decode(model, prompts, max_new_tokens) -> PaddedGeneration:
    """BROKEN: ``generate_padded`` whose decode steps pass positions but no pad mask."""
    batch = left_pad(prompts)
    ids, pad = batch.ids, batch.pad
    cache, start, chosen, logits = model.new_cache(ids.shape[0]), 0, [], []
    for step in range(max_new_tokens):
        C = ids.shape[1]
        mask = padded_mask(pad, start, C) if step == 0 else None  # BUG: decode steps unmasked
        out, cache = model(ids, cache, last_only=True, positions=padded_positions(pad, start, C),
                           attn_mask=mask)
        logits.append(out[:, -1])
        ids = out[:, -1].argmax(dim=-1, keepdim=True)
        chosen.append(ids)
        start += C
    return PaddedGeneration(torch.cat(chosen, dim=1), torch.stack(logits, dim=1))


@pytest.mark.parametrize("name", EVERY)
def test_generate_padded_rows_equal_their_solo_runs_on_every_model(name):
    assert padded_as_alone(grid.MODELS[name].build(0))


def test_padding_bugs_are_caught_by_generate_padded():
    model = grid.MODELS["mha"].build(0)
    # verify's former variant generate-padded-unmasked-decode: no pad mask on decode steps
    assert not padded_as_alone(model, generate_padded_unmasked_decode)
    # the same bug in the decoder, and split-K reading pad keys: variants the padded check sees
    assert not padded_as_alone(copy_as(model, DecodeWithoutPadMaskDecoder))
    assert not padded_as_alone(pad_leak_split_k(model))


def test_split_k_pad_leak_is_caught_by_the_padded_check():
    (outcome,) = sweep_variants(["split-k-pad-leak"], stop_at_first=False,
                                dtypes=(torch.float32,), length=24,
                                scenarios=["padded", "last_only", "stream"])
    assert outcome.report.failed_checks() == ["padded"]
