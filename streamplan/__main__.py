"""``python -m streamplan``: the ``streamplan`` command."""
import sys

from .tools.cli import main

sys.exit(main())
