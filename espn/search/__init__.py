"""The query side of an index: the Searcher facade and the pipeline it runs.

Kept light on purpose: importing `espn.search.searcher` loads torch and FAISS, so nothing
is imported here (`from espn import Searcher` loads it on first use).
"""
