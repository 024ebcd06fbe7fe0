"""PyLate's own `ColBERT.encode` against espn's on one checkpoint: `python tests/pylate_reference.py PATH`.

Run by test_colbert_encoder with PYTHONPATH=$ESPN_PYLATE_SITE first: a directory holding
pylate and the versions it pins (sentence-transformers 5.3.0, transformers 5.3.0,
tokenizers 0.22.1, huggingface-hub 1.3.0), installed with `pip install --no-deps --target`.
PyLate's training and index dependencies (datasets, voyager, fast-plaid, ...) are not
installed: they are stubbed as empty modules, since encoding never touches them.
"""
import importlib.abc
import importlib.machinery
import sys
import types

MISSING = ("datasets", "ujson", "voyager", "sqlitedict", "fastkmeans", "fast_plaid", "ninja")
class Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"): raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None})
class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in MISSING:
            try:
                if name.split(".")[0] not in sys.modules:
                    importlib.machinery.PathFinder.find_spec(name.split(".")[0])
            except Exception: pass
            if importlib.machinery.PathFinder.find_spec(name.split(".")[0]) is None:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None
    def create_module(self, spec): m = Stub(spec.name); m.__path__ = []; return m
    def exec_module(self, module): pass
sys.meta_path.insert(0, Finder())
import numpy as np
from pylate import models
from espn.encoders.colbert import ColBERTEncoder
path = sys.argv[1]
m = models.ColBERT(path, device="cpu")
e = ColBERTEncoder(path, device="cpu", query_backend="torch")
queries = ["What causes the phases of the Moon?", "hydrogen fusion in stars", "a long question " * 20]
docs = ["The Moon's phases occur because we see different portions of its sunlit half, as it orbits Earth!",
        "Stars like the Sun fuse hydrogen into helium; energy leaves the core.", "word " * 400]
pq = m.encode(queries, is_query=True); pd = m.encode(docs, is_query=False)
eq = e.encode_queries(queries); ed = e.encode_documents(docs)
worst = 0.0
for i, v in enumerate(pq):
    got = eq.bow[i][eq.mask[i]]; assert got.shape == np.asarray(v).shape, (got.shape, np.asarray(v).shape); worst = max(worst, float(np.abs(got - v).max()))
for (c, got), v in zip(ed.split(), pd):
    assert got.shape == np.asarray(v).shape, (got.shape, np.asarray(v).shape); worst = max(worst, float(np.abs(got - v).max()))
print("pylate", __import__("pylate").__version__, "vs espn: shapes equal, max |difference|", worst)
