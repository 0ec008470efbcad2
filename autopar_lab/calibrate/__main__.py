"""``python -m autopar_lab.calibrate``."""

import sys

from .cli import main

sys.exit(main())
