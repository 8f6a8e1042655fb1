"""``python -m streamplan``: the ``streamplan`` command."""
import sys

from .cli import main

sys.exit(main())
