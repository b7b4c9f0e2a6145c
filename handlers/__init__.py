"""Event handlers for Wait cases: Timer, FileWatch, SocketListen, Signal."""
