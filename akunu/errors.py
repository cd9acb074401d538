"""Errors a user can cause. The CLI prints their message as one line and exits non-zero."""


class AkunuError(Exception):
    """Base for every user-facing error: the message is the whole story, no traceback."""

    exit_code = 1


class ModelError(AkunuError):
    """A model cannot be found, fetched, parsed or supported."""


class PromptError(AkunuError):
    """The prompt is empty or longer than the model's context."""


class Interrupted(AkunuError):
    """Ctrl-C before there was anything to show."""

    exit_code = 130


class OptionsError(AkunuError):
    """Options conflict or are out of range."""

    exit_code = 2
