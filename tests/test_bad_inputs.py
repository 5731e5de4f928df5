"""Every entry of the bad-input catalogue (kvdoc.teach.refusals) is refused, caches intact.

The same catalogue feeds the reference page "What kvdoc refuses". The last tests check the
checker: an accepted call, a wrong message and a refusal that touched a cache are all caught.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvdoc.teach import refusals
from kvdoc.teach.refusals import CATALOGUE, CommandError, Fixtures, Refusal, attempt


@pytest.mark.parametrize("refusal", CATALOGUE, ids=[r.key for r in CATALOGUE])
def test_bad_input_is_refused_and_caches_are_unchanged(refusal: Refusal):
    outcome = attempt(refusal)
    assert outcome.ok, outcome.explain()


def test_catalogue_is_broad():
    keys = [r.key for r in CATALOGUE]
    assert len(keys) >= 20 and len(set(keys)) == len(keys)
    areas = {r.area for r in CATALOGUE}
    assert {"GPTConfig", "Decoder", "caches", "masks", "generation", "interop", "CLI"} <= areas
    assert all(r.fragment and r.call and r.bad for r in CATALOGUE)


def test_fixture_caches_hold_the_prompt():
    fx = Fixtures.make()
    assert fx.dynamic.seq_len == fx.static.seq_len == fx.foreign.seq_len == fx.ids.shape[1] == 4
    assert fx.foreign.layers[0].heads != fx.model.config.n_kv_head


def test_cli_refusal_is_the_same_out_of_process():
    result = subprocess.run([sys.executable, "-m", "kvdoc", "train"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "invalid choice: 'train'" in result.stderr, result
    with pytest.raises(CommandError, match=r"exit 2: .*invalid choice: 'train'"):
        refusals.run_cli("train")


def _entry(run, fragment: str = "boom") -> Refusal:
    return Refusal("probe", "caches", "a probe", "probe()", ValueError, fragment, run)


def test_checker_catches_an_accepted_call():
    outcome = attempt(_entry(lambda fx: fx.dynamic.crop(2)))  # a valid call: nothing is refused
    assert not outcome.ok and outcome.raised is None and "was accepted" in outcome.explain()


def test_checker_catches_a_wrong_message_or_type():
    assert not attempt(_entry(lambda fx: GPTConfig_bad(), fragment="something else")).ok
    not_a_cache = _entry(lambda fx: fx.model(torch.tensor([[1]]), fx.dynamic.tensors()),
                         fragment="nope")
    outcome = attempt(not_a_cache)
    assert outcome.raised == "ValueError" and not outcome.matches and not outcome.ok
    type_error = attempt(_entry(lambda fx: (_ for _ in ()).throw(TypeError("boom"))))
    assert type_error.raised == "TypeError" and not type_error.ok


def test_checker_catches_a_refusal_that_changed_a_cache():
    def crop_then_raise(fx: Fixtures) -> None:
        fx.static.crop(2)  # in place: the static cache loses two positions
        raise ValueError("boom")

    def write_then_raise(fx: Fixtures) -> None:
        fx.dynamic.layer(0)[0].add_(1.0)  # same length, different bytes
        raise ValueError("boom")

    for run in (crop_then_raise, write_then_raise):
        outcome = attempt(_entry(run))
        assert outcome.matches and not outcome.caches_unchanged and not outcome.ok, outcome


def GPTConfig_bad() -> None:
    from kvdoc import GPTConfig

    GPTConfig(n_layer=0)
