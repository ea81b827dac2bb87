"""One exception type per kind of user mistake; the CLI prints each as one line."""

# Set by `eagle3 --debug` for the processes a command starts: tracebacks, library request logs.
DEBUG_ENV = "EAGLE3_DEBUG"


class PipelineError(Exception):
    """A problem the user can fix; the message names the file, the field and the fix."""


class ParamsError(PipelineError):
    """params.yaml (or a profile) is wrong."""


class DataError(PipelineError):
    """An input data file is missing, empty or malformed."""


class StoreError(PipelineError):
    """The hidden-state store is missing, corrupt or inconsistent."""


class VerifierError(PipelineError):
    """The verifier (config, tokenizer or weights) cannot be used as configured."""


class CheckpointError(PipelineError):
    """A drafter checkpoint cannot be loaded or does not match the run."""


class ServerError(PipelineError):
    """A vLLM server did not start or did not answer."""


class ServerDown(ServerError):
    """A vLLM server this run started stopped serving in the middle of the work (its watch)."""


class DiskError(PipelineError):
    """A write failed for a reason of the filesystem (full, quota, I/O error, read-only)."""
