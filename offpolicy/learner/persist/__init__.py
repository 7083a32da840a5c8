"""What a learner makes durable: file generations, checkpoints, and the writes that make them durable.

`Persistence` (durable_writes.py) starts them at step boundaries; the background writer (writer.py) writes
them off the critical path. A file generation (file_generation.py) is one published version as files;
checkpoints have one interface (checkpoint.py) with a backend per layout (one process: files, single.py;
N ranks: DCP, dcp.py), chosen once at start; on N ranks the weights reach rank 0 in the background
(background_gather.py)."""

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
from offpolicy.learner.persist.durable_writes import Persistence
from offpolicy.learner.persist.file_generation import (
    HostCopy,
    WeightsSnapshot,
    publish_snapshot,
    publish_weights,
)
from offpolicy.learner.persist.single import FileCheckpoints, make_checkpoints
from offpolicy.learner.persist.version_folders import published_versions, version_dir
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
