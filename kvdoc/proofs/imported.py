"""The ``imported`` scenario: a model loaded from transformers computes transformers' function.

The ``reference`` scenario exports each model to transformers and compares; the other entry
point, :func:`kvdoc.interop.hf_weights.from_transformers`, reads a transformers model (its
config and its weights) into kvdoc. Here the model is exported, that transformers model is
imported back through ``from_transformers``, and the import's full forward and its cached path
(chunks, its own dynamic cache) must equal the transformers model's logits: the library that
wrote the config and weights is the oracle, so a value the importer reads wrongly (a RoPE base,
a window, a norm's epsilon) shows even where the exporter wrote it right.

One combination per model and dtype (the dynamic kind, the model's own call); models without a
transformers family (GPT-2 with grouped K/V heads) do not apply.

>>> import torch
>>> from kvdoc.proofs.suite import run_suite
>>> report = run_suite(models=("llama",), kinds=("dynamic",), impls=("model",),
...                    dtypes=(torch.float32,), scenarios=("imported",))
>>> report.passed, report.results[0].detail
(True, 'transformers Llama, same weights: imported full and in chunks of 13')
"""

from __future__ import annotations

from kvdoc.interop.hf_deepseek import to_deepseek
from kvdoc.interop.hf_weights import from_transformers, to_transformers

from .case import Case, scenario
from .compare import run_cached
from .references import deepseek_reference, hf_reference, transformers_reference

EXPORTERS = {transformers_reference: to_transformers, deepseek_reference: to_deepseek}
"""A model's exporter, by the reference its grid entry names."""


@scenario("imported", {"imported": "from_transformers() of the exported model, full and cached, "
                                   "vs transformers' logits"})
def _imported(case: Case, out: list) -> None:
    export = EXPORTERS.get(case.spec.reference)
    if export is None or case.kind != "dynamic" or case.impl != "model":
        out.append(case.result("imported", None, 0.0, "one combination per model with a "
                               "transformers family"))
        return
    importer = case.caches.get("importer", from_transformers)  # a variant's
    hf = export(case.model)
    model = importer(hf).to(case.dtype).eval()
    want = hf_reference(hf, case.model)(case.ids)
    chunk = case.chunks[-1]
    cache = model.new_cache(case.ids.shape[0])
    cached = run_cached(model, case.ids, chunk, cache=cache).logits
    out.append(case.compared("imported", [(model(case.ids)[0], want), (cached, want)],
                             f"{case.spec.reference_name}: imported full and in chunks of "
                             f"{chunk}"))
