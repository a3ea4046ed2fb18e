"""The error the build core raises when a JIT module cannot be used (the Dispatcher falls back)."""

from __future__ import annotations


class JitUnavailable(RuntimeError):
    """The JIT module cannot be used; ``reason`` is one line, ``log_path`` the full log if any."""

    def __init__(self, reason: str, log_path: str | None = None):
        super().__init__(reason + (f" (log: {log_path})" if log_path else ""))
        self.reason = reason
        self.log_path = log_path
