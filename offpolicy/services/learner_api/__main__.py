"""`python -m offpolicy.services.learner_api [--config F] [--host H] [--port P]`: the learner service, the
entry
torchrun starts on every rank (`offpolicy learner --nproc-per-node N` runs
`torchrun --standalone --nproc-per-node N -m offpolicy.services.learner_api ...`)."""

import sys

from offpolicy.services.cli import main

if __name__ == "__main__":
    sys.exit(main(["learner", *sys.argv[1:]]))
