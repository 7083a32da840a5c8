"""What a learner makes durable: the background writer, published weight versions, and checkpoints behind
one interface with a backend per layout (one process: files; N ranks: DCP), chosen once at start."""

from offpolicy.learner.persist.checkpoint import (
    FILE_FORMAT,
    SHARDED_FORMAT,
    Checkpoints,
    NoCheckpoints,
    checkpoint_versions,
    latest_checkpoint,
    read_meta,
)
from offpolicy.learner.persist.dcp import ShardedCheckpoints
from offpolicy.learner.persist.persistence import Persistence, make_checkpoints
from offpolicy.learner.persist.published import (
    HostCopy,
    WeightsSnapshot,
    publish_snapshot,
    publish_weights,
    published_versions,
    version_dir,
)
from offpolicy.learner.persist.single import FileCheckpoints
from offpolicy.learner.persist.writer import BackgroundWriter, WeightsBuffers

__all__ = [
    "FILE_FORMAT",
    "SHARDED_FORMAT",
    "BackgroundWriter",
    "Checkpoints",
    "FileCheckpoints",
    "HostCopy",
    "NoCheckpoints",
    "Persistence",
    "ShardedCheckpoints",
    "WeightsBuffers",
    "WeightsSnapshot",
    "checkpoint_versions",
    "latest_checkpoint",
    "make_checkpoints",
    "publish_snapshot",
    "publish_weights",
    "published_versions",
    "read_meta",
    "version_dir",
]
