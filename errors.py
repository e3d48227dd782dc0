"""The user-error family: exceptions that mean "this input is wrong", not "pallasite has a bug".

Every error a user can cause with a config, a path, a prompt or a flag derives from ``UserError``
and carries a message that names the input and what was expected. ``pallasite.cli.main`` catches
this family (and ``OSError``, which names its file) once and prints one line instead of a
traceback; ``--debug`` or ``PALLASITE_DEBUG=1`` shows the traceback. The concrete classes also
derive from the built-in exception a caller would expect (``ValueError``), so ``except
ValueError`` keeps working. This module imports nothing, so every module may import it.
"""

from __future__ import annotations


class UserError(Exception):
    """Base of the errors a user's input causes (the message names the input)."""


class ConfigError(UserError, ValueError):
    """A bad experiment-config key or value (names the key and the expected type or values)."""


class InputError(UserError, ValueError):
    """A bad argument: a prompt, a length, a sampling value, a model path that holds no model."""


class DataError(UserError, ValueError):
    """A data or model file whose content is wrong: a jsonl line, a corrupt safetensors file."""


class ResumeError(UserError, ValueError):
    """A workdir whose checkpoint cannot be resumed by this config (names the differing fields)."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a training run; the message says which step it resumes from."""


def is_user_error(exc: BaseException) -> bool:
    """True for the user-error family and for file-system errors (they name their file)."""
    return isinstance(exc, (UserError, OSError))


def describe(exc: BaseException) -> str:
    """One line for the user: the message, with an OSError's errno prefix replaced by its file."""
    if isinstance(exc, OSError) and not isinstance(exc, UserError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror}"
    text = str(exc) if not isinstance(exc, KeyError) or not exc.args else str(exc.args[0])
    return " ".join(text.split()) or type(exc).__name__


__all__ = [
    "UserError",
    "ConfigError",
    "InputError",
    "DataError",
    "ResumeError",
    "TrainingInterrupted",
    "is_user_error",
    "describe",
]
