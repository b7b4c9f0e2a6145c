"""What tests share besides fixtures (those live in tests/conftest.py).

- `harness`: a real `workflowd` subprocess on a config under a temporary folder.
- `client`: the async JSON-lines protocol client, and a ping run as another user.
- `wait`: wait for a condition with a ceiling (`wait_status`, `settled`, `logged`, `until`...).
- `support`: in-process doubles: the `Recorder` handler and the engine `Driver`.
- `memory`: an in-memory control backend, served on a real socket in the test process.
- `probes`: descriptors and Unix sockets a process holds (/proc), a SocketListen client.
- `disk`: a small tmpfs to fill, and a database write lock held from outside.
- `torture`: the crash-torture driver shared by tests/e2e and tests/benchmarks.
- `disk_torture`: the torture's disk-full phase (the database's tmpfs fills up under load).
"""

from pathlib import Path

#: The checkout (the folder holding daemon/, handlers/, tests/ and config.toml).
REPO = Path(__file__).resolve().parents[2]
