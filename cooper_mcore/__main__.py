"""``python -m cooper_mcore``: the ``cooper`` command."""

import sys

from cooper_mcore.cli import main

if __name__ == "__main__":
    sys.exit(main())
