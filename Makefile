# One place for install steps: a fresh machine needs only python3 and make.
VENV ?= .venv
PY := $(VENV)/bin/python
ESPN := $(VENV)/bin/espn
SAMPLE_INDEX ?= .espn/sample-index
# torch's CPU build. From PyPI alone, `pip install torch` on Linux x86-64 gets the CUDA build
# (several GB of NVIDIA libraries). PyTorch's CPU index has 2.13.0+cpu, which pip prefers to
# PyPI's 2.13.0 when it is asked with both. If that index cannot be reached, pip says so and
# takes what it finds elsewhere (a local CPU wheel, or PyPI's CUDA build): the line printed
# after the install names the build you got. GPU machines: TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_VERSION := 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# --retries 1: an unreachable index costs one retry per package, not five.
TORCH_PIP = --retries 1 torch==$(TORCH_VERSION) --extra-index-url $(TORCH_INDEX)
# Installs skip byte-compiling (pip's --no-compile: torch, transformers and scipy are thousands of
# modules a run never imports) and Python writes the .pyc of what it does import, at first import,
# even where the environment says not to (PYTHONDONTWRITEBYTECODE=1 in some CI images): without
# either, every test process would compile torch again.
NO_COMPILE := --no-compile
export PYTHONDONTWRITEBYTECODE :=
TORCH_BUILD = import torch; print(f"torch {torch.__version__}:", f"the CUDA {torch.version.cuda} build" if torch.version.cuda else "the CPU build")

.PHONY: install serve-sample test wheel check-wheel check-built-wheel browser bench clean settings-table docs docs-strict

$(VENV)/.installed: pyproject.toml clients/python/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first, pinned (see TORCH_INDEX above).
	$(PY) -m pip install -q $(TORCH_PIP) $(NO_COMPILE)
	$(PY) -m pip install -q -e '.[test,bench,docs]' $(NO_COMPILE)
	# The typed client (its own distribution, clients/python) with the three frameworks' retrievers
	# and LangChain's standard tests, for tests/test_client.py and tests/test_retrievers.py.
	$(PY) -m pip install -q -e './clients/python[langchain,llama-index,haystack,test]' $(NO_COMPILE)
	# Which torch build pip took, asked once numpy is installed (torch imported without numpy warns).
	@$(PY) -c '$(TORCH_BUILD)'
	touch $@

install: $(VENV)/.installed

# Main job on the built-in default: index the bundled sample corpus (once) and serve it.
serve-sample: install
	@test -f $(SAMPLE_INDEX)/manifest.json || $(ESPN) index espn/data/sample_corpus.jsonl --out $(SAMPLE_INDEX)
	$(ESPN) serve $(SAMPLE_INDEX)

# The documentation site (no broken link or anchor) and the wheel are built first; then the test
# suite runs (tests/test_docs_site.py opens the site built here in a browser) while mypy and the
# wheel's check in a fresh venv run beside it (mostly one core and pip's I/O), their reports
# printed after the suite's. The suite runs on TEST_WORKERS pytest-xdist workers, each test file on
# one worker (its module fixtures, such as a running server, start once); most tests wait on
# subprocesses, so more workers than cores pays. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 4
test: install browser
	$(MAKE) docs-strict wheel
	@mkdir -p .espn; $(VENV)/bin/mypy > .espn/mypy.log 2>&1 & typing=$$!; \
	$(MAKE) --no-print-directory check-built-wheel > .espn/check-wheel.log 2>&1 & wheeled=$$!; \
	echo "$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25"; \
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25; tested=$$?; \
	wait $$typing; typed=$$?; wait $$wheeled; checked=$$?; \
	echo "mypy:"; cat .espn/mypy.log; echo "make check-built-wheel:"; cat .espn/check-wheel.log; \
	test $$tested -eq 0 -a $$typed -eq 0 -a $$checked -eq 0

# The documentation site (mkdocs.yml, docs/): generated pages first (the CLI's --help, the
# settings tables, the OpenAPI document), then the HTML in site/ (`make docs`) or, checked with
# --strict, in .espn/site (`make test`). Open site/index.html, or `mkdocs serve` for live reload.
DOCS_SITE ?= site
docs: install
	$(PY) -m tools.docs_pages docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d $(DOCS_SITE)

docs-strict: install
	$(PY) -m tools.docs_pages docs --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d .espn/site

# Debian's Chromium and its driver for the search page's browser test (tests/test_page.py).
# Skipped when both are present, or when ESPN_BROWSER_TESTS=0 turns that test off.
browser:
	@if [ "$$ESPN_BROWSER_TESTS" = "0" ] || { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then :; else \
		SUDO=$$([ "$$(id -u)" -ne 0 ] && echo sudo); \
		$$SUDO apt-get -o DPkg::Lock::Timeout=600 update -q && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends chromium chromium-driver; \
	fi

# The built wheel, no extras, in a fresh venv: a runtime dependency missing from
# pyproject.toml fails here (the dev venv has the test extras, which would hide it).
WHEEL_VENV := .espn/wheel-venv
WHEEL_CHECK := .espn/wheel-check
# The wheel, built in the tree (its own build/), before anything else builds there.
wheel: install
	rm -rf $(WHEEL_CHECK) build && mkdir -p $(WHEEL_CHECK)/dist
	$(PY) -m pip wheel -q --no-deps -w $(WHEEL_CHECK)/dist .

check-wheel: wheel
	$(MAKE) check-built-wheel

# Installs the wheel `make wheel` built into a fresh venv and runs the main job with it.
check-built-wheel:
	rm -rf $(WHEEL_VENV)
	python3 -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q $(TORCH_PIP) $(NO_COMPILE)
	$(WHEEL_VENV)/bin/python -m pip install -q $(NO_COMPILE) --only-binary tantivy $(WHEEL_CHECK)/dist/espn-*.whl
	cd /tmp && $(CURDIR)/$(WHEEL_VENV)/bin/espn --help > /dev/null
	$(WHEEL_VENV)/bin/espn index espn/data/sample_corpus.jsonl --out $(WHEEL_CHECK)/index --no-progress
	$(WHEEL_VENV)/bin/espn search $(WHEEL_CHECK)/index --queries espn/data/sample_queries.jsonl \
		--qrels espn/data/sample_qrels.tsv --out $(WHEEL_CHECK)/run.trec --k 10
	$(WHEEL_VENV)/bin/espn search $(WHEEL_CHECK)/index --queries espn/data/sample_queries.jsonl \
		--qrels espn/data/sample_qrels.tsv --out $(WHEEL_CHECK)/hybrid.trec --k 10 --mode hybrid
	# Object storage is an extra: without boto3, --publish is refused in one line, before serving.
	! $(WHEEL_VENV)/bin/espn serve $(WHEEL_CHECK)/index --publish s3://bucket/prefix 2> $(WHEEL_CHECK)/publish.err
	grep -q "pip install 'espn\[s3\]'" $(WHEEL_CHECK)/publish.err
	# The client's wheel (clients/python), no extras, in a venv of its own: it imports with httpx
	# and pydantic alone (no torch, FAISS or numpy), and a retriever's missing framework is one line.
	rm -rf $(WHEEL_VENV) && python3 -m venv $(WHEEL_VENV)
	$(PY) -m pip wheel -q --no-deps -w $(WHEEL_CHECK)/client-dist ./clients/python
	$(WHEEL_VENV)/bin/python -m pip install -q $(NO_COMPILE) $(WHEEL_CHECK)/client-dist/espn_client-*.whl
	cd /tmp && $(CURDIR)/$(WHEEL_VENV)/bin/python -c 'import importlib.util as u, espn_client; \
		from espn_client import Client, AsyncClient; \
		assert not [m for m in ("torch", "faiss", "numpy", "espn") if u.find_spec(m)], "more than httpx and pydantic"'
	cd /tmp && ! $(CURDIR)/$(WHEEL_VENV)/bin/python -c 'import espn_client.langchain' 2> $(CURDIR)/$(WHEEL_CHECK)/client.err
	grep -q "pip install 'espn-client\[langchain\]'" $(WHEEL_CHECK)/client.err
	rm -rf $(WHEEL_VENV) $(WHEEL_CHECK)

# The docs' settings tables, from the settings models (server/settings.py): run after adding a setting.
settings-table: install
	$(PY) -m espn_server.settings_doc --write docs/reference/settings.md

clean:
	rm -rf $(VENV) .espn site
