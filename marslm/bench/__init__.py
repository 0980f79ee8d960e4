"""How fast: decoding speed side by side in one process and the cost curve (``marslm bench``), a
training step against an AR one (``marslm bench --train-step``), and a running server under load
(``marslm loadtest``, for either engine). None of it is needed to train or decode."""
