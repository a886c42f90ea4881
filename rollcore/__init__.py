"""rollserve's core: what the frontend (``serving``) and the backend handlers (``handlers``) share and both
depend on -- the request and result types of the worker channel (``types``), the error kinds (``errors``),
the option schema (``options``) with its value parsers (``values``), and the engine's step-cost sums
(``step_cost``). It imports nothing of either side, and no torch."""
