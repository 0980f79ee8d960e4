"""Tooling around the method: the demos, the ablation, benchmarks, the load test, plots and the
token-by-forward view. None of it is needed to train or decode with MARS (that is ``marslm``'s
top level and ``marslm.decode``); all of it is how the project measures and shows it."""
