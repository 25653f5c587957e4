"""`python -m cbrun ...` runs the command line."""

import sys

from cbrun.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
