"""Errors that carry a message meant for the user, not a traceback."""


class ConfigError(ValueError):
    """Bad user input: an unknown config value, an invalid number, missing data, an unreadable file.

    The message is one line that names the problem and says how to fix it. ``train.py`` prints it as
    ``error: <message>`` and exits with status 2 without writing any result.
    """
