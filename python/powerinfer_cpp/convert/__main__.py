"""``python -m powerinfer_cpp.convert``: see cli.py."""

import sys

from .cli import main

sys.exit(main())
