"""``python -m serving`` is the ``serving`` command."""

from serving.cli import main

main()
