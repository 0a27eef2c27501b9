"""Exceptions that mpidist raises on every rank at once, so no rank is left waiting, and the
one way their messages name ranks."""


def format_ranks(ranks) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (sorted ranks)."""
    out, start = [], None
    ranks = list(ranks)
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


class MismatchError(ValueError):
    """Ranks disagree on something that must be identical (length, dtype, op, call order)."""


class RemoteError(RuntimeError):
    """Another rank failed; raised on the ranks that did not, naming the ranks that did."""


class ConfigError(ValueError):
    """A job configuration is invalid; raised before any work starts."""
