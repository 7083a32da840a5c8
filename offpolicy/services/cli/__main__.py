"""`python -m offpolicy.services.cli ARGS`: the `offpolicy` command without its console script."""

import sys

from offpolicy.services.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
