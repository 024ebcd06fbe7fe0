"""The centroid first stage for models without a trained CLS vector: its format and estimate
(`centroids`), its build (`build`) and its search beside the candidate reads (`search`)."""
