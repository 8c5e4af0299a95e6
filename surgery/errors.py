"""The one exception type the library raises for bad input."""


class SurgeryError(Exception):
    """Bad input or an unsupported model: one line saying what is wrong and what to do.

    The CLI prints it as `error: <message>` and exits 1. Any other exception is a bug. The public functions raise it
    for what the caller can fix (a path that holds no model, a layer out of range, an unknown option, a block a pass
    refuses); the message is `str(error)`, and the `Raises:` section of each function says when.
    """
