"""The live generation: its on-disk format and record (`format`), the files one publish writes
(`segment_files`), a generation opened for search (`segments`), and the lease that lends its
Searcher out one search at a time (`live_searcher`)."""
