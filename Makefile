# kvdoc: `make html` builds the site, `make test` runs every test. Both set up .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Sphinx executes this many pages at once, each kernel on one torch thread (docs/_ipython): one a
# core, at most 4, so a large machine does not hold 27 kernels and their models in memory at once.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
SPHINXOPTS ?= -W --keep-going -j $(JOBS)
SPHINXBUILD := $(BIN)/sphinx-build
DOCS ?= docs
BUILDDIR ?= $(DOCS)/_build
DOCTREES = $(BUILDDIR)/doctrees

# The browser check of every built page needs the built site, so `make pytest` leaves it out
# and `make test` runs it (site-check) after the HTML build.
SITE_TEST := tests/test_site.py::test_every_built_page
# Compared with a second clean build by repro-check; empty: build both.
REPRO_REF ?=

.PHONY: help html test lint pytest doctest sphinx-html page clean distclean venv site-check repro-check numeric-check peer-check screenshots

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 14

# The environment is rebuilt whenever the package metadata or the pins change. pip runs at -qq:
# errors still show, its warnings about this machine's absent local index folders do not.
# Compiling the installed modules to bytecode is half of pip's work and pip does it on one core;
# compileall does the same on every core. Like pip it ignores a file this Python cannot compile
# (torch ships one in 3.12 syntax). Skipping it costs more than it saves: where
# PYTHONDONTWRITEBYTECODE is set, as on the project's machines, every kernel would compile torch
# and transformers again at each import.
$(STAMP): pyproject.toml constraints.txt
	@echo "Setting up $(VENV): installing kvdoc and what its pages and tests import (first run, or"
	@echo "after pyproject.toml or constraints.txt changed; minutes, quiet until done. Without a CPU"
	@echo "torch already in $(VENV), pip may download several GB of CUDA libraries: see README.md)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -qq --disable-pip-version-check --no-compile -c constraints.txt -e '.[docs,test]'
	@echo "Compiling the installed modules to bytecode"
	$(BIN)/python -c 'import compileall, sys; compileall.compile_dir(sys.argv[1], quiet=2, workers=0)' $(VENV)/lib
	touch $@
	@echo "$(VENV) is ready"

# The notebook pages (MyST-NB executes each in a kernel of its own).
NOTEBOOKS = $(shell grep -rlx --include='*.md' --exclude-dir=_build 'file_format: mystnb' $(DOCS) | wc -l)

venv: $(STAMP)  ## create .venv and install kvdoc with its docs and test extras

# Each build writes into an empty folder: Sphinx links a static file with `?v=<checksum>` only if
# the file is already in the output, so a rebuild in place would differ from a clean build.
html: $(STAMP)  ## build the site into docs/_build/html (every notebook page executed)
	@echo "Building the site: $(NOTEBOOKS) notebook pages, each executed unless the execution cache"
	@echo "holds its outputs ($(JOBS) at a time; a line per page as it starts)"
	rm -rf $(BUILDDIR)/html
	$(SPHINXBUILD) -b html -E $(SPHINXOPTS) -d $(DOCTREES) $(DOCS) $(BUILDDIR)/html
	@echo "Site: $(BUILDDIR)/html/index.html"

doctest: $(STAMP)  ## run the {doctest} blocks of the pages with Sphinx's doctest builder
	$(SPHINXBUILD) -b doctest $(SPHINXOPTS) -d $(DOCTREES) $(DOCS) $(BUILDDIR)/doctest

lint: $(STAMP)  ## ruff: style, import order, likely bugs (rules in pyproject.toml)
	$(BIN)/ruff check .

# On $(JOBS) cores, each worker on one torch thread (tests/conftest.py). worksteal: an idle worker
# takes tests queued for a busy one, since one verification-suite test runs for minutes.
pytest: $(STAMP)  ## unit tests and the docstring examples of the kvdoc package
	$(BIN)/python -m pytest -n $(JOBS) --dist worksteal --deselect $(SITE_TEST)

site-check: $(STAMP)  ## load every built page in headless Chromium, offline (needs make html)
	KVDOC_SITE=$(BUILDDIR)/html $(BIN)/python -m pytest -s -p no:cacheprovider $(SITE_TEST)

# doctest reuses the environment html pickled in $(DOCTREES): it runs the pages' {doctest} blocks
# without executing a notebook again.
test: lint pytest html doctest site-check  ## lint, pytest, the strict HTML build, the pages' doctests, the browser check

repro-check: $(STAMP)  ## two clean builds must write the same site (REPRO_REF=dir reuses one build)
	rm -rf $(BUILDDIR)/repro
	$(if $(REPRO_REF),,$(MAKE) --no-print-directory html BUILDDIR=$(BUILDDIR)/repro/a)
	$(MAKE) --no-print-directory html BUILDDIR=$(BUILDDIR)/repro/b
	$(BIN)/python scripts/compare_builds.py $(or $(REPRO_REF),$(BUILDDIR)/repro/a/html) $(BUILDDIR)/repro/b/html

# vLLM and SGLang are not installed (both need a GPU build): their releases' files come from PyPI
# into .peer/ (about 90 MB, once). Not part of `make test`, which needs nothing from the network;
# `.ci/run` runs it. Then kvdoc's prefix-cache workloads through SGLang's radix tree and vLLM's
# block pool, with ample memory and under eviction.
peer-check: $(STAMP)  ## vLLM/SGLang links and names against their releases; their caches run
	$(BIN)/python scripts/peer_check.py
	$(BIN)/python scripts/peer_replay.py --offline

# A second numeric setting: ATen's portable kernels instead of this CPU's vector ones, MKL's
# conditional-numerical-reproducibility path, two threads in every page's kernel (docs/_ipython).
# The last bits of every float change (as they do on another CPU), so a page that asserts this
# machine's rounding fails here. The portable kernels are slower, and this check is about
# numbers, not speed: a cell may take 900 s (600 s elsewhere). Two kernels of two threads each
# share two cores here: OpenMP's threads, by default spinning while they wait, then took 10 to 40
# times as long on a small model's forward as with OMP_WAIT_POLICY=PASSIVE (they sleep instead),
# which changes when a thread waits, not how the work is split, so not the numbers.
NUMERIC_ENV := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE KVDOC_THREADS=2 KVDOC_EXECUTE=force \
	KVDOC_CELL_TIMEOUT=900 OMP_WAIT_POLICY=PASSIVE
numeric-check: $(STAMP)  ## execute every page again in a second numeric setting (strict, into _build/numeric)
	rm -rf $(BUILDDIR)/numeric
	$(NUMERIC_ENV) $(SPHINXBUILD) -b html -E $(SPHINXOPTS) -d $(BUILDDIR)/numeric/doctrees $(DOCS) $(BUILDDIR)/numeric/html

# A phone: make screenshots WIDTH=412 SCALE=2 PAGES="part3/6-memory.html" (SITE=$(BUILDDIR)/page
# after make page).
WIDTH ?= 1280
SCALE ?= 1
SITE ?= $(BUILDDIR)/html
SHOTS ?= $(BUILDDIR)/screenshots
screenshots: $(STAMP)  ## render the built pages to PNG in docs/_build/screenshots (needs make html)
	$(BIN)/python scripts/browser.py screenshots --width $(WIDTH) --scale $(SCALE) $(SITE) $(SHOTS) $(PAGES)

page: $(STAMP)  ## build the landing page and one page only: make page PAGE=part2/1-question
	@test -n "$(PAGE)" || { echo "usage: make page PAGE=part2/1-question (globs allowed)"; exit 2; }
	rm -rf $(BUILDDIR)/page
	KVDOC_PAGES="$(PAGE)" $(SPHINXBUILD) -b html -E $(SPHINXOPTS) -d $(BUILDDIR)/page-doctrees $(DOCS) $(BUILDDIR)/page
	@echo "Page: $(BUILDDIR)/page/$(PAGE).html"

clean:  ## remove the built site and the execution cache (keeps .venv)
	rm -rf $(BUILDDIR)

distclean: clean  ## also remove .venv
	rm -rf $(VENV)
