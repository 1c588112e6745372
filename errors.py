"""User-facing errors.

Anything a user can cause — bad config, bad input data, a missing package, a
checkpoint made for another target — raises a :class:`DraftsmithError` whose
message says what is wrong *and what to do*. The CLI prints these without a
traceback; everything else is a bug and keeps its traceback.
"""


class DraftsmithError(Exception):
    """An error caused by the user's input, with a message naming the fix."""


class ConfigError(DraftsmithError):
    """A config key, value or combination that is not valid."""
