"""python -m jitkv.benchmark: jitkv against torch (and its own fallbacks) in the same run."""
