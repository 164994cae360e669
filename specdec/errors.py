"""The one error type users see: bad input, bad checkpoints, incompatible models."""


class SpecDecError(ValueError):
    """A problem the user can fix; its message says what and where.

    The CLI prints the message and exits non-zero; the server answers 4xx, naming `param` (the
    request field at fault) when there is one.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
