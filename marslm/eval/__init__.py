"""How well a checkpoint does: task accuracy at each tau (``marslm eval``), the probe of what
training kept and learned (``marslm probe``), the lm-evaluation-harness adapter, and the views of
one generation (``marslm show``) and of a report (``marslm plot``)."""
