"""Left-padded batches: each row equals its prompt run alone; the unshifted-positions variant is
caught."""

import pytest
import torch

from kvdoc import Decoder, GPTConfig
from kvdoc.proofs.compare import TOLERANCE
from kvdoc.serving.batching import generate_padded, left_pad, padded_mask, padded_positions
from kvdoc.teach.broken_shown import unshifted_positions
from kvdoc.teach.serving_checks import compare_with_alone


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
@pytest.mark.parametrize("lengths", [[3, 9, 1, 6], [5, 5], [7]])
def test_each_row_equals_its_prompt_alone(lengths, n_kv_head):
    torch.manual_seed(0)
    model = Decoder(GPTConfig(n_kv_head=n_kv_head)).eval()
    rows = compare_with_alone(model, prompts(1, lengths), max_new_tokens=6)
    assert [r.pad for r in rows] == [max(lengths) - n for n in lengths]
    assert all(r.passed for r in rows), rows


def test_float64(model):
    rows = compare_with_alone(model.double(), prompts(2, [2, 8]), max_new_tokens=4)
    assert all(r.passed for r in rows)
    assert max(r.logit_error for r in rows) <= TOLERANCE[torch.float64]


def test_unshifted_positions_are_caught(model):
    lengths = [3, 9, 1, 6]
    rows = compare_with_alone(model, prompts(1, lengths), max_new_tokens=6,
                              under_test=unshifted_positions(model))
    # A row without padding is untouched by the bug; every padded row fails the check.
    assert [r.passed for r in rows] == [n == max(lengths) for n in lengths]


def test_mask_and_positions():
    pad = torch.tensor([0, 2])
    assert padded_positions(pad, 0, 4).tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]
    mask = padded_mask(pad, 0, 4)
    assert mask.shape == (2, 4, 4)
    assert torch.equal(mask[0], torch.ones(4, 4, dtype=torch.bool).tril())
    # Row 1: real queries (slots 2, 3) read real keys only; pad queries read earlier pads.
    assert mask[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    decode = padded_mask(pad, 4, 1)  # one new slot after four
    assert decode.int().tolist() == [[[1, 1, 1, 1, 1]], [[0, 0, 1, 1, 1]]]


def test_bad_input_is_refused(model):
    with pytest.raises(ValueError, match="at least one prompt"):
        left_pad([])
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []])
    with pytest.raises(ValueError, match="integer token ids"):
        left_pad([[1.5]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_padded(model, [[1]], 0)
    with pytest.raises(ValueError, match="positions"):
        generate_padded(model, [[1] * 500], 20)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate_padded(model, [[1, 200]], 2)


@pytest.mark.parametrize("name", ["llama", "mistral", "split-k", "mla", "mla-absorbed", "gemma3"])
def test_every_model_padded_equals_each_prompt_alone(name):
    # RoPE turns each row at its own positions; prompts past the window of 16 check the window
    from kvdoc.proofs.grid import MODELS

    model = MODELS[name].build(0)
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
            for n in (23, 4, 40)]
    checks = compare_with_alone(model, rows, max_new_tokens=5)
    assert all(r.passed for r in checks), checks
