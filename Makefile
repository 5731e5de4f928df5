# kvdoc: `make html` builds the site, `make test` runs every test. Both set up .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SPHINXOPTS ?= -W --keep-going
SPHINXBUILD := $(BIN)/sphinx-build
DOCS ?= docs
BUILDDIR ?= $(DOCS)/_build
DOCTREES = $(BUILDDIR)/doctrees

.PHONY: help html test pytest doctest sphinx-html page clean distclean venv

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 14

# The environment is rebuilt whenever the package metadata or the pins change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[docs,test]'
	touch $@

venv: $(STAMP)  ## create .venv and install kvdoc with its docs and test extras

html: $(STAMP)  ## build the site into docs/_build/html (every notebook page executed)
	$(SPHINXBUILD) -b html -E $(SPHINXOPTS) -d $(DOCTREES) $(DOCS) $(BUILDDIR)/html
	@echo "Site: $(BUILDDIR)/html/index.html"

doctest: $(STAMP)  ## run the {doctest} blocks of the pages with Sphinx's doctest builder
	$(SPHINXBUILD) -b doctest $(SPHINXOPTS) -d $(DOCTREES) $(DOCS) $(BUILDDIR)/doctest

pytest: $(STAMP)  ## unit tests and the docstring examples of the kvdoc package
	$(BIN)/python -m pytest

test: pytest html doctest  ## pytest, then the strict HTML build, then the pages' doctests

page: $(STAMP)  ## build the landing page and one page only: make page PAGE=part1/1-question
	@test -n "$(PAGE)" || { echo "usage: make page PAGE=part1/1-question (globs allowed)"; exit 2; }
	KVDOC_PAGES="$(PAGE)" $(SPHINXBUILD) -b html -E $(SPHINXOPTS) -d $(BUILDDIR)/page-doctrees $(DOCS) $(BUILDDIR)/page
	@echo "Page: $(BUILDDIR)/page/$(PAGE).html"

clean:  ## remove the built site and the execution cache (keeps .venv)
	rm -rf $(BUILDDIR)

distclean: clean  ## also remove .venv
	rm -rf $(VENV)
