"""The method end to end on one machine: the embedded toy default and its tiny model
(``marslm demo``, ``make demo``), the SmolLM2-135M run (``--preset smollm2``), and the paper's
ablation on the toy suite (``marslm ablate``). Only the CLI imports this package."""
