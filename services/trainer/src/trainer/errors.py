"""Trainer errors: additions to the shared tree (see lorastack.errors).

    LorastackError
    ├── ConfigError
    └── Refused
        ├── PreflightRefused   the dataset check found samples that cannot be trained on
        ├── ResumeRefused      the run manifest of the checkpoint differs from this run
        ├── SmokeFailed        --smoke / --overfit verdict was "fail"
        └── TrainingOOM        the device ran out of memory (hint: which knob to turn)
    ├── CheckpointWriteFailed  a checkpoint could not be written (disk full, I/O error);
    │                          the previous one is intact and --resume continues from it
    ├── HookNotRun         (exit 6) the results could not be verified off this host, so
    │                      the on_complete hook (which may stop the host) did not run
    ├── HookFailed         (exit 5) the hook ran and failed or timed out; what was
    │                      published stays published
    └── TrainingCrashed    an unexpected error; support-bundle.json was written

`CostCapReached` (exit 4) is a stop the user asked for: the run reached its max_cost or
max_hours, published a checkpoint, and the message gives the command that resumes it.
`TrainingInterrupted` is not an error the user caused: SIGTERM/SIGINT was received, a
checkpoint was written, and the process exits with 130 so a scheduler can restart it.
"""

from __future__ import annotations

from lorastack.errors import LorastackError, Refused


class PreflightRefused(Refused):
    """The dataset check refused the data; the message holds the report."""


class ResumeRefused(Refused):
    """--resume found a different run manifest; the message lists what changed."""


class SmokeFailed(Refused):
    """A smoke or overfit run finished with a failing verdict."""


class TrainingOOM(Refused):
    """Out of device memory."""


class TrainingInterrupted(LorastackError):
    """Stopped by a signal after writing a checkpoint."""

    exit_code = 130


class CostCapReached(LorastackError):
    """The run reached max_cost or max_hours and stopped after publishing a checkpoint."""

    exit_code = 4


class CheckpointWriteFailed(LorastackError):
    """Writing a checkpoint failed; nothing of it is left and the previous one is intact."""


class HookNotRun(LorastackError):
    """A hook did not run: what it must follow is not verified in a store off this host."""

    exit_code = 6


class HookFailed(LorastackError):
    """A hook exited non-zero or timed out; the published results are untouched."""

    exit_code = 5


class TrainingCrashed(LorastackError):
    """An unexpected exception during a run; the message gives the support bundle path."""
