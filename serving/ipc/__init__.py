"""The frontend <-> worker channel: typed messages (``messages``) and their framing (``codec``).

Both sides depend on this package and on nothing of each other: the batchers (``serving.batching``) build and
read these messages, the worker package (``serving.worker``) carries them; neither imports the other
(``tests/unit/test_import_boundaries.py`` reads the imports to keep it so).
"""
