# One place for install steps: a fresh machine needs only python3 and make.
VENV ?= .venv
PY := $(VENV)/bin/python
ESPN := $(VENV)/bin/espn
SAMPLE_INDEX ?= .espn/sample-index

.PHONY: install serve-sample test bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first, pinned: an unpinned torch pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

# Main job on the built-in default: index the bundled sample corpus (once) and serve it.
serve-sample: install
	@test -f $(SAMPLE_INDEX)/manifest.json || $(ESPN) index espn/data/sample_corpus.jsonl --out $(SAMPLE_INDEX)
	$(ESPN) serve $(SAMPLE_INDEX)

# Type check, then the test suite.
test: install
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV) .espn
