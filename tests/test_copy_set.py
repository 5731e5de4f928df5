"""The copy set runs alone: ``core/model.py`` and ``core/cache.py`` copied into an empty
package, with torch and nothing of kvdoc, serve a cached decode equal to the full forward."""

import shutil
import subprocess
import sys
from pathlib import Path

import kvdoc

CORE = Path(kvdoc.__file__).parent / "core"

SCRIPT = """
import sys
import torch
from copyset.cache import DynamicCache, StaticCache
from copyset.model import Decoder, GPTConfig, generate, llama_config

# a window of 3 over 6 tokens: the copy set's windows, served by caches that keep every row
# (the ring that keeps only the window, the default kind of such a model, is core/window.py)
for config in (GPTConfig(), llama_config(), llama_config(sliding_window=3)):
    torch.manual_seed(0)
    model = Decoder(config).eval()
    ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
    with torch.no_grad():
        full = model(ids).logits
        for cache in (DynamicCache.empty(config, 1), StaticCache(config, 1, capacity=8)):
            _, cache = model(ids[:, :4], cache)
            step = model(ids[:, 4:], cache).logits
            assert torch.allclose(step, full[:, 4:], atol=1e-5), config
    for kind in ("dynamic", "static"):
        assert generate(model, ids[:, :3], 4, cache=kind).shape == (1, 7)
windowed = Decoder(llama_config(sliding_window=3))
try:
    windowed.new_cache(1)
except ImportError as e:  # what a copy without core/window.py says
    assert "window" in str(e), e
else:
    raise AssertionError("the window ring came from outside the two files")
print(sorted(name for name in sys.modules if name.startswith("kvdoc")))
"""


def test_the_two_files_run_with_torch_alone(tmp_path):
    package = tmp_path / "copyset"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("model.py", "cache.py"):
        shutil.copy(CORE / name, package / name)
    # -I: isolated, so neither the working directory nor PYTHONPATH can bring kvdoc back
    run = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, "
                          f"{str(tmp_path)!r})\n{SCRIPT}"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"  # no module of kvdoc was imported
