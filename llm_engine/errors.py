"""The engine's errors that callers catch, importable without torch (a CLI reports them)."""


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says what to fix, in one line."""


class IncompatiblePairError(ValueError):
    """The draft cannot serve this target; the message lists the first differences."""
