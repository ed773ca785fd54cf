"""``python -m gradsync.run``: the elastic driver (see :mod:`gradsync.run`)."""

import sys

from .driver import main

sys.exit(main())
