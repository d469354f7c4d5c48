"""``python -m imagefeed``: the ``pack-dataset`` command line (see :mod:`imagefeed.pack_dataset`)."""

import sys

from .pack_dataset import main

sys.exit(main())
