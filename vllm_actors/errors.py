"""Typed errors raised at the package's boundaries.

Every error a user can cause carries a message that names the thing at fault and what to do.
This module imports nothing else from the package.
"""

from __future__ import annotations

from pathlib import Path


class VllmActorsError(Exception):
    """Base class of every error this package raises on purpose."""


class ValidationError(VllmActorsError, ValueError):
    """Bad request input (a sampling parameter, a prompt too long, ...); HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(VllmActorsError):
    """The engine core stopped; every pending request fails with this (HTTP 503)."""


class WorkerDiedError(VllmActorsError):
    """A worker process of a multi-process engine died or failed; the engine core stops
    (and the frontend then raises EngineDeadError)."""


class RequestFailedError(VllmActorsError):
    """One request failed inside the engine (finish_reason "error"); others were unaffected."""


class ModelLoadError(VllmActorsError):
    """A model, tokenizer or weight file could not be used.

    The message always starts with the offending path so a person can find it.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path does not exist, or the default model is not installed."""


class ModelFormatError(ModelLoadError):
    """A file exists but is malformed: truncated, wrong magic, inconsistent header."""


class UnsupportedModelError(ModelLoadError):
    """A well-formed file that uses something we do not implement (architecture, tensor type)."""


def error_from_wire(error_type: str, message: str, param: str | None = None) -> Exception:
    """Rebuild an error raised in another process from its class name and message: our own
    typed errors keep their class, anything else becomes a VllmActorsError."""
    cls = next((c for c in _all_subclasses(VllmActorsError) if c.__name__ == error_type), None)
    if cls is None:
        return VllmActorsError(f"{error_type}: {message}")
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    if issubclass(cls, ValidationError):
        error.param = param
    return error


def _all_subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out
