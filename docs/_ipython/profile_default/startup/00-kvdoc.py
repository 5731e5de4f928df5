# Run by every kernel that executes a page (docs/conf.py points IPYTHONDIR here), so pages carry
# only what a reader needs. A downloaded page runs the same without it: threads change speed,
# not what a page asserts. (Fixed SVG ids come from docs/_ext/matplotlibrc.)
import os
import warnings

import torch

# Tiny tensors: one thread is fastest and keeps a shared machine quiet. `make numeric-check`
# asks for two, one of the ways it changes the last bits of every float.
torch.set_num_threads(int(os.environ.get("KVDOC_THREADS", "1")))

# transformers' progress bars ask for ipywidgets, which the build does not install; the warning
# says nothing about a page
warnings.filterwarnings("ignore", message="IProgress not found")

# transformers says once a process that an optional kernel package the build does not install
# is missing ("... is falling back to its reference PyTorch implementation"): nothing about a
# page, and it lands on whichever page first runs such a model in a process. The broken-variant
# sweep runs on one page and is read by the other, so with the notice two builds of one commit
# differed (make repro-check). Its errors still show.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
