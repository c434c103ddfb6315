"""``python -m kvshelf.cli ...``: the ``kvshelf`` command without its console script."""

from kvshelf.cli import main

main()
