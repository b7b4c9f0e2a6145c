"""The Python client for workflowd's control socket: `from daemon.client import Client`."""

from daemon.control.aclient import AsyncClient
from daemon.control.client import (
    BadInput,
    BadRequest,
    Client,
    ClientError,
    Conflict,
    Forbidden,
    Internal,
    InvalidDefinition,
    NoSocket,
    NotFound,
    Stale,
    TooLarge,
    Unavailable,
    UnknownOp,
    Unreachable,
    WaitTimeout,
    find_socket,
)

__all__ = [
    "AsyncClient",
    "BadInput",
    "BadRequest",
    "Client",
    "ClientError",
    "Conflict",
    "Forbidden",
    "Internal",
    "InvalidDefinition",
    "NoSocket",
    "NotFound",
    "Stale",
    "TooLarge",
    "Unavailable",
    "UnknownOp",
    "Unreachable",
    "WaitTimeout",
    "find_socket",
]
