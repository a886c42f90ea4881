"""``serving tune``: the serving.properties with the highest goodput meeting an SLO, searched on live servers.

Parts: ``space`` (groups x live knobs), ``evaluator`` (real servers behind the ``ports.Evaluator`` protocol),
``runs`` (a run against an SLO), ``racing`` (a configuration against the best so far), ``costs`` (the budget's
predictions), ``moves`` and ``policy`` (the search), ``verify`` (the head-to-head), ``plan``, ``report`` and
``cli``."""
