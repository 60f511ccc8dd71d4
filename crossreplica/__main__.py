"""``python -m crossreplica``: the ``crossreplica`` command (``cli.py``)."""

import sys

from .cli import main

sys.exit(main())
