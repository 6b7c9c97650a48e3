"""Planning a run before it starts: one rank's memory in a layout from a symbolic trace of the run's own
code (:mod:`~dit_mcore.plan.memory`), checked against real steps (``docs/planning.md``)."""
