"""`python -m offpolicy.services.learner_api [--config F] [--host H] [--port P]`: the learner service, the
entry torchrun starts on every rank (`offpolicy learner --nproc-per-node N` runs
`torchrun --standalone --nproc-per-node N -m offpolicy.services.learner_api ...`). A rank of a process
group ends without the interpreter's teardown (learner/distributed/ranks.py `leave`: why)."""

import sys

from offpolicy.learner.distributed import current
from offpolicy.learner.distributed.ranks import leave
from offpolicy.services.cli import main

if __name__ == "__main__":
    code = main(["learner", *sys.argv[1:]])
    if current().distributed:
        leave(code)
    sys.exit(code)
