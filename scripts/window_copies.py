"""Rows a window layer writes per decode step, and the step's time, on the tree on the path.

    python scripts/window_copies.py                       # this checkout
    PYTHONPATH=<older checkout> python scripts/window_copies.py

A Mistral-style model (window W = 64) is prefilled with 256 tokens, then decodes 8; the copy
meter (:class:`kvdoc.measure.dispatch.CopyMeter`) counts the bytes every cache write moves,
printed in rows of K and V per layer. A decode step past the window is then timed 200 times on
one thread (median and interquartile range; an observation of this machine, not a fact).
"""

import statistics
import time

import torch

from kvdoc import Decoder
from kvdoc.core.model import mistral_config
from kvdoc.measure.dispatch import CopyMeter

torch.manual_seed(0)
torch.set_num_threads(1)
W, T = 64, 256
model = Decoder(mistral_config(sliding_window=W, n_positions=1024)).eval()
ids = torch.randint(0, model.config.vocab_size, (1, T + 8))
meter = CopyMeter()
with torch.no_grad():
    _, cache = model(ids[:, :T], meter.watch(model.new_cache(1, "window")))
    for t in range(T, T + 8):
        _, cache = model(ids[:, t:t + 1], cache)
row = 2 * model.config.n_kv_head * model.config.head_dim * 4  # K and V of one position, FP32
rows = sorted({written / model.config.n_layer / row for _, written, _ in meter.per_step()[1:]})
print(f"rows of K and V written per layer per decode step (W = {W}):", rows)

times = []
with torch.no_grad():
    _, base = model(ids[:, :T], model.new_cache(1, "window"))
    for step in range(205):
        start = time.perf_counter()
        model(ids[:, T:T + 1], base)
        if step >= 5:  # the first calls warm up
            times.append(time.perf_counter() - start)
low, _, high = statistics.quantiles(times, n=4)
print(f"decode step past the window: median {statistics.median(times) * 1e6:.0f} us, "
      f"IQR {low * 1e6:.0f} to {high * 1e6:.0f} us")
