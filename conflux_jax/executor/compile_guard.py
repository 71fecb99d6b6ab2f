"""Fail loudly if XLA compiles anything while serving (a bucket was missed at warm-up)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax.monitoring

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_compiles = 0
_registered = False


def _listener(event: str, duration: float, **_: object) -> None:
    global _compiles
    if event == _BACKEND_COMPILE:
        with _lock:
            _compiles += 1


def compile_count() -> int:
    """Backend compilations in this process since the first guard was created."""
    return _compiles


class RecompilationError(RuntimeError):
    pass


class CompileGuard:
    """``serving = True`` after warm-up; then any compilation inside ``watch()`` raises."""

    def __init__(self) -> None:
        global _registered
        with _lock:
            if not _registered:
                jax.monitoring.register_event_duration_secs_listener(_listener)
                _registered = True
        self.serving = False

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        before = _compiles
        yield
        if self.serving and _compiles != before:
            raise RecompilationError(
                f"{_compiles - before} XLA compilation(s) happened while serving; every step "
                "shape must be compiled at warm-up")
