"""Event handlers for Wait cases: Timer, FileWatch, SocketListen, Signal."""

from .callback import Signal
from .filewatch import FileWatch
from .listen import SocketListen
from .timer import Timer

__all__ = ["FileWatch", "Signal", "SocketListen", "Timer"]
