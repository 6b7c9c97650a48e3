"""Planning a run before it starts (``python -m dit_mcore.plan``): every layout the layout check accepts on a
cluster, with one rank's memory from a symbolic trace of the run's own code (:mod:`~dit_mcore.plan.memory`) and
a step time from the trace's work at measured rates (:mod:`~dit_mcore.plan.step_time`), ranked
(:mod:`~dit_mcore.plan.search`); ``docs/planning.md``."""
