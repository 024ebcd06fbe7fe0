"""The repository's own tools (not shipped): generators of the documentation's derived parts."""
