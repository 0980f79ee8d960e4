"""``marslm serve``: an OpenAI-compatible HTTP server over marslm's own continuous-batching engine."""
