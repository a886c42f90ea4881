"""``serving bench`` and ``serving tune``: load scenarios, vLLM's metrics and goodput, the knob search.

A client of the server (it never runs in the server process); needs the ``bench`` extra.
"""
