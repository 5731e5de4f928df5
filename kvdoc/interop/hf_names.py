"""The transformers names the site shows, resolved against the installed release.

The name map and the pages name classes, methods and keywords of transformers 5.24. Each is a
:class:`Name` in :data:`NAMES`: a dotted path that must resolve, the parameters its signature
must take (in that order, others may come between) and those it must not take (a keyword of an
older release). :func:`unresolved` lists what does not hold; the name map's page fails its build
when the list is not empty. :func:`behaviour_errors` runs the claims about what a name does.

>>> unresolved()
[]
>>> unresolved([Name("transformers.DynamicCache.crop", ("max_length",)),
...             Name("transformers.NoSuchCache")])  # doctest: +NORMALIZE_WHITESPACE
['transformers.DynamicCache.crop takes (self, tokens_to_remove), not max_length',
 'transformers.NoSuchCache does not resolve: no NoSuchCache in transformers']
>>> behaviour_errors()
[]
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Name:
    """One name the site shows (see the module docstring)."""

    path: str
    takes: tuple[str, ...] = ()
    lacks: tuple[str, ...] = ()


_FORWARD = ("input_ids", "attention_mask", "position_ids", "cache")
NAMES: tuple[Name, ...] = (
    Name("transformers.Cache"),
    Name("transformers.DynamicCache"),
    Name("transformers.StaticCache"),
    Name("transformers.Cache.update", ("key_states", "value_states", "layer_idx"),
         lacks=("cache_kwargs",)),
    Name("transformers.DynamicCache.crop", ("tokens_to_remove",)),
    Name("transformers.Cache.get_seq_length"),
    Name("transformers.Cache.get_query_offset"),
    Name("transformers.Cache.get_mask_sizes", ("query_length", "layer_idx")),
    Name("transformers.masking_utils.create_causal_mask",
         ("config", "inputs_embeds", "attention_mask", "cache", "position_ids"),
         lacks=("cache_position", "past_key_values")),
    Name("transformers.LlamaForCausalLM.forward", (*_FORWARD, "use_cache", "logits_to_keep"),
         lacks=("cache_position",)),
    Name("transformers.GPT2LMHeadModel.forward",
         ("input_ids", "cache", "attention_mask", "position_ids"), lacks=("cache_position",)),
    Name("transformers.MistralForCausalLM.forward", _FORWARD, lacks=("cache_position",)),
    Name("transformers.GenerationMixin.generate"),
)
"""Every transformers name the site's pages show, as transformers 5.24 spells it."""


def _resolve(path: str) -> object:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):  # the longest prefix that imports is the module
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, attr):
                raise LookupError(f"no {attr} in {'.'.join(parts[:i])}")
            obj = getattr(obj, attr)
        return obj
    raise LookupError(f"no module {parts[0]}")


def _in_order(wanted: Sequence[str], have: Sequence[str]) -> bool:
    rest = iter(have)
    return all(w in rest for w in wanted)


def unresolved(names: Sequence[Name] = NAMES) -> list[str]:
    """What does not hold of ``names`` in the installed transformers, one line each."""
    errors = []
    for name in names:
        try:
            obj = _resolve(name.path)
        except LookupError as missing:
            errors.append(f"{name.path} does not resolve: {missing}")
            continue
        if not (name.takes or name.lacks):
            continue
        params = list(inspect.signature(obj).parameters)
        shown = f"({', '.join(params)})"
        if not _in_order(name.takes, params):
            errors.append(f"{name.path} takes {shown}, not {', '.join(name.takes)}")
        errors += [f"{name.path} takes {shown}, including {p}" for p in name.lacks
                   if p in params]
    return errors


def behaviour_errors() -> list[str]:
    """The site's claims about what transformers' names do, run: ``DynamicCache.crop`` takes
    a negative count of positions to drop, and ``SlidingWindowCache`` is at most another name
    of ``StaticCache``."""
    import torch
    import transformers

    errors = []
    cache = transformers.DynamicCache()
    kv = torch.zeros(1, 1, 5, 2)
    cache.update(kv, kv, 0)
    try:
        cache.crop(2)
        errors.append("DynamicCache.crop(2) did not refuse a positive count")
    except ValueError:
        pass
    cache.crop(-2)
    if cache.get_seq_length() != 3:
        errors.append(f"DynamicCache.crop(-2) left {cache.get_seq_length()} of 5 positions")
    sliding = getattr(transformers.cache_utils, "SlidingWindowCache", None)
    if sliding not in (None, transformers.StaticCache):
        errors.append("SlidingWindowCache is a cache class of its own")
    return errors
