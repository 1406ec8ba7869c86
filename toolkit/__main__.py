"""`python -m toolkit`: the same command as the `toolkit` console script."""

import sys

from toolkit.entry import main

sys.exit(main())
