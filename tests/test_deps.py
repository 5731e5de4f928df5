"""Tests for kvdoc.teach.dependency_maps: both methods must find the same dependencies, hidden
ones too."""

from __future__ import annotations

import pytest
import torch

from kvdoc import Decoder, GPTConfig
from kvdoc.measure.tables import markdown_table
from kvdoc.teach.decoder_sites import (
    decoder_function,
    decoder_sites,
    decoder_values,
    kv_rows_changed,
)
from kvdoc.teach.dependency_maps import (
    compare_maps,
    dependency_map,
    jacobian_map,
    lower_triangular,
    map_table,
    perturbation_map,
    token_dependency_map,
)

SMALL = GPTConfig(vocab_size=11, n_positions=16, n_layer=2, n_head=2, n_embd=8, n_inner=16)


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def both(fn, x, **kw):
    a, b = jacobian_map(fn, x, **kw), perturbation_map(fn, x, **kw)
    return a, b


def test_last_row_depends_on_an_earlier_row_both_methods():
    # Row 3 of the output reads row 1 of the input (and itself); nothing else mixes rows.
    def fn(x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(x)
        return torch.cat([out[:3], out[3:] + x[1:2].sin() * 0.5], dim=0)

    x = rand(4, 3)
    for m in both(fn, x):
        assert m.rows_needed(-1) == [1, 3], m.method
        expected = torch.eye(4, dtype=torch.bool)
        expected[3, 1] = True
        assert torch.equal(m.depends, expected), m.method
    assert compare_maps(*both(fn, x)).ok


def test_weak_but_real_dependency_is_found_by_both():
    # A coupling of 1e-6 is small but not zero: it must count as a dependency.
    fn = lambda x: x + 1e-6 * x[0:1].expand_as(x)  # noqa: E731
    for m in both(fn, rand(3, 2)):
        assert m.depends[:, 0].all() and m.depends[2].tolist() == [True, False, True], m.method


def test_row_local_ops_give_the_identity_pattern_batched():
    x = rand(2, 5, 4, seed=1)  # [B, T, d]
    W = rand(4, 6, seed=2)
    ln = torch.nn.LayerNorm(4).double()
    for fn in (lambda x: x @ W, ln, lambda x: torch.softmax(x, -1), torch.nn.functional.gelu):
        m = dependency_map(fn, x)
        assert torch.equal(m.depends, torch.eye(5, dtype=torch.bool))


def test_matmul_of_two_activations_mixes_rows():
    x = rand(5, 4, seed=3)
    m = dependency_map(lambda x: x @ x.T, x)  # [T, T]: row t reads every row
    assert m.depends.all()


def test_causal_attention_is_lower_triangular_and_magnitudes_agree():
    x = rand(1, 6, 8, seed=4)
    # Small weights keep the softmax away from saturation, where a weight can round to exactly 0.
    Wq, Wk, Wv = (0.2 * rand(8, 8, seed=s) for s in (5, 6, 7))

    def attn(x):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return sdpa(x @ Wq, x @ Wk, x @ Wv, is_causal=True)

    m = dependency_map(attn, x)
    assert torch.equal(m.depends, lower_triangular(6))
    assert m.agreement.max_rel_diff < 1e-5


def test_compare_detects_a_disagreement():
    x = rand(3, 2)
    a = jacobian_map(lambda x: x.cumsum(0), x)
    b = jacobian_map(lambda x: x * 2, x)
    res = compare_maps(a, b)
    assert not res.same_pattern and not res.ok
    with pytest.raises(AssertionError):
        res.check()


def test_output_rows_and_single_row_outputs():
    x = rand(2, 4, 3)
    m = dependency_map(lambda x: x[:, -1, :], x, out_row_dim=None)  # [B, T, d] -> [B, d]
    assert m.depends.tolist() == [[False, False, False, True]]
    m = jacobian_map(lambda x: x.cumsum(-2), x, out_rows=[-2])
    assert m.out_rows == (2,) and m.rows_needed() == [0, 1, 2]


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match=r"must be a \[T, d\] or \[B, T, d\] tensor"):
        jacobian_map(lambda x: x, torch.ones(3))
    with pytest.raises(ValueError, match="must be floating point"):
        perturbation_map(lambda x: x, torch.ones(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"output rows \[5\] out of range"):
        jacobian_map(lambda x: x, rand(3, 2), out_rows=[5])
    with pytest.raises(ValueError, match="eps must be positive"):
        perturbation_map(lambda x: x, rand(3, 2), eps=0.0)
    with pytest.raises(ValueError, match=r"unknown site 'h9\.k'"):
        decoder_function(Decoder(SMALL), torch.tensor([[1, 2]]), "h9.k")
    with pytest.raises(ValueError, match="one cell per header"):
        markdown_table(["a"], [[1, 2]])


def test_renderers():
    m = jacobian_map(lambda x: x.cumsum(0), rand(3, 2)).relabel(["A", "B", "C"], ["a", "b", "c"])
    table = map_table(m, ["A", "B", "C"], ["a", "b", "c"])
    assert "<th>out \\ in</th><th>A</th><th>B</th><th>C</th>" in table
    assert table.split("<tr>")[-1].count("●") == 3
    fig = m.heatmap(title="cumsum")
    assert fig.axes[0].get_title() == "cumsum"
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.fixture(scope="module")
def model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(SMALL)


def test_decoder_sites_reproduce_the_forward(model):
    idx = torch.tensor([[1, 2, 3, 4]])
    values = decoder_values(model, idx)
    assert set(values) == set(decoder_sites(model))
    with torch.no_grad():
        assert torch.equal(values["logits"], model(idx).logits)
    fn, x0 = decoder_function(model, idx, "h0.q")
    assert torch.allclose(fn(x0).float(), model(idx).logits, atol=1e-5)


def test_decoder_logits_are_causal_over_embeddings(model):
    idx = torch.tensor([[1, 2, 3, 4]])
    fn, x0 = decoder_function(model, idx, "embed")
    assert torch.equal(dependency_map(fn, x0).depends, lower_triangular(4))


def test_pinning_k_and_v_leaves_only_the_last_row(model):
    idx = torch.tensor([[1, 2, 3, 4]])
    kv = [f"h{layer}.{p}" for layer in range(SMALL.n_layer) for p in "kv"]
    free, x0 = decoder_function(model, idx, "h0.q")
    pinned, _ = decoder_function(model, idx, "h0.q", pin=kv)
    # Without pinning, earlier Q rows of layer 0 reach the last logits through layer 1's K/V,
    # except row 0: the first query sees one key, its softmax weight is 1 whatever q_0 is.
    assert dependency_map(free, x0, out_rows=[-1]).rows_needed() == [1, 2, 3]
    assert dependency_map(pinned, x0, out_rows=[-1]).rows_needed() == [3]
    fn, k0 = decoder_function(model, idx, "h1.k", pin=[p for p in kv if p != "h1.k"])
    assert dependency_map(fn, k0, out_rows=[-1]).rows_needed() == [0, 1, 2, 3]


def test_token_map_and_kv_rows_changed(model):
    idx = torch.tensor([[1, 2, 3, 4]])
    m = token_dependency_map(lambda i: model(i).logits, idx, SMALL.vocab_size)
    assert torch.equal(m.depends, lower_triangular(4))
    e = kv_rows_changed(model, idx, torch.tensor([[1, 7, 3, 4]]))
    assert e.k_changed[0].tolist() == [False, True, False, False]  # layer 0 K is row-local
    assert e.k_changed[1].tolist() == [False, True, True, True]  # layer 1 K saw the edit
    assert torch.equal(e.k_changed, e.v_changed)
    with pytest.raises(ValueError, match="the prompts must have one shape"):
        kv_rows_changed(model, idx, idx[:, :3])
