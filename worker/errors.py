"""One error hierarchy. Library code raises these; the CLI turns them into messages and exit codes,
and the pipeline turns per-image ones into recorded failures."""

from __future__ import annotations


class WorkerError(Exception):
    """Base of every error the worker raises on purpose."""

    exit_code = 1


class ConfigError(WorkerError):
    """A config file or model card is invalid: the message names the file, the key and what was expected."""

    exit_code = 2


class CheckInputError(WorkerError):
    """A file given to a parity check (an expected tensor, outputs, an image) cannot be used: one line saying why."""

    exit_code = 2


class ModelError(WorkerError):
    """A model cannot be obtained, verified or loaded."""


class ProviderError(WorkerError):
    """The requested execution provider (for example CUDA with require_gpu) is not active."""


class StoreError(WorkerError):
    """The database cannot be opened or migrated."""


class OutboxFull(WorkerError):
    """The outbox's filesystem has no room (disk full, quota): no image's fault, so the images wait."""


class ImageError(WorkerError):
    """One image cannot be processed. Recorded against the image; the worker keeps going."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class DecodeError(ImageError):
    """The file is not an image we can decode (empty, truncated, wrong format)."""


class ImageTooLarge(ImageError):
    """The image's header announces more pixels than the configured limit (decompression bomb guard)."""


class InputGone(ImageError):
    """The file disappeared or became unreadable between being queued and being read."""
