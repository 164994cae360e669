"""The one error type users see: bad input, bad checkpoints, incompatible models."""


class SpecDecError(ValueError):
    """A problem the user can fix; its message says what and where.

    The CLI prints the message and exits non-zero; the server answers 4xx, naming `param` (the
    request field at fault) when there is one.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def check_integer(value, name: str, minimum: int = 1, maximum: int | None = None, param: str | None = None) -> int:
    """`value` itself when it is an integer (not a bool) within [minimum, maximum]; else the one
    error every front end's checks raise, naming `name`."""
    if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
            or (maximum is not None and value > maximum)):
        if maximum is not None:
            wanted = f"an integer from {minimum} to {maximum}"
        else:
            wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise SpecDecError(f"{name} must be {wanted}, got {value!r}", param=param)
    return value
