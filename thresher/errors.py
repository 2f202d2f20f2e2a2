"""One exception type per class of user-facing failure.

The CLI prints these without a traceback (``--debug`` shows it); anything else is a bug.
"""


class ThresherError(Exception):
    """Base class: a failure the user can act on, with a message that says how."""


class RecipeError(ThresherError):
    """A recipe that does not validate; the message names the field path."""


class ModelError(ThresherError):
    """A model that cannot be resolved, loaded or adapted."""


class UnsupportedArchitectureError(ModelError):
    """A model family without an adapter."""


class CheckpointError(ModelError):
    """A weights file that is corrupt, truncated, or holds a tensor its config does not describe;
    the message names the file (and the tensor)."""


class DataError(ThresherError):
    """A text source that cannot be read or yields too little text."""


class ArtifactError(ThresherError):
    """A published artifact that is missing, incomplete or fails its hash check."""


class StorageError(ThresherError):
    """A write that failed (disk full, read-only, no permission); the message names the path, and
    nothing partial was left in its place."""


class EvaluationError(ThresherError):
    """Two sets of scores that cannot be compared as asked: paired by document or window, their
    documents or windows differ."""


class CompressionError(ThresherError):
    """A pruning or quantization stage whose options do not fit the model."""


class ExportError(ThresherError):
    """A model that cannot be written in another runtime's format (GGUF) as asked."""


class TrackingError(ThresherError):
    """The MLflow tracking server or the Prefect API cannot be reached or refuses a request."""


class ExecutionError(ThresherError):
    """A fanned-out run failed for good (retries spent), or the local stack could not start."""
