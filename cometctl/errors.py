"""The one error type that reaches the user as a single line and a non-zero exit code."""


class CometError(Exception):
    """A failure the user can act on; the CLI prints its message, not a traceback."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code
