"""Page corpora for visual search: reading pages from folders, PDFs and manifests (`corpus`),
the page images stored with an index (`images`) and each page's patch grid beside them
(`grids`), and reading them by doc number (`stored`)."""
