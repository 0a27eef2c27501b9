"""Exceptions that mpidist raises on every rank at once, so no rank is left waiting."""


class MismatchError(ValueError):
    """Ranks disagree on something that must be identical (length, dtype, op, call order)."""


class RemoteError(RuntimeError):
    """Another rank failed; raised on the ranks that did not, naming the ranks that did."""


class ConfigError(ValueError):
    """A job configuration is invalid; raised before any work starts."""
