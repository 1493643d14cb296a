"""The pipeviz commands' usage error: one line on stderr, exit status 2."""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["Parser", "UsageError"]


class UsageError(Exception):
    """A bad argument or an unreadable input: one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, whose errors are UsageError."""

    def error(self, message: str) -> NoReturn:
        # argparse would print the whole usage block; one line says it and keeps scripts readable.
        raise UsageError(message)
