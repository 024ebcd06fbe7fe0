"""The offline index build job: encode a corpus into chunk files, then assemble an index."""
