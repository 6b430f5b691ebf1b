"""The one base class of every error a user can cause (bad file, bad flag, budget that cannot fit)."""


class PocketMoEError(Exception):
    """A user-facing error: ``str(e)`` is one sentence naming the thing, the numbers, and the fix."""
