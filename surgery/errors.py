"""The one exception type the library raises for bad input."""


class SurgeryError(Exception):
    """Bad input or an unsupported model: one line saying what is wrong and what to do.

    The CLI prints it as `error: <message>` and exits 1. Any other exception is a bug.
    """
