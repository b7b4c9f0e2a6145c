"""The control socket: protocol, server, sessions, and the workflowctl client."""
