"""The learner's control of its own off-policyness: the staleness bound it trains with (`staleness.py`,
`control.mode: auto`) and the actor capacity it asks for (`capacity.py`)."""

from offpolicy.learner.control.capacity import Capacity, Sample, Supply
from offpolicy.learner.control.staleness import ESS_KEY, MASK_KEYS, REASONS, Change, StalenessControl

__all__ = ["ESS_KEY", "MASK_KEYS", "REASONS", "Capacity", "Change", "Sample", "StalenessControl", "Supply"]
