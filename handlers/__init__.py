"""Event handlers for Wait cases: Timer, FileWatch, SocketListen, Signal, Child."""

from .callback import Signal
from .child import Child
from .filewatch import FileWatch
from .listen import SocketListen
from .timer import Timer

__all__ = ["Child", "FileWatch", "Signal", "SocketListen", "Timer"]
