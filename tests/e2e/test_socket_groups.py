"""Groups on the control socket: `socket_group` for a socket the daemon binds itself, and an
allow-list checked against the groups the peer process holds, not the user database.

Clients run as other uids (setpriv), so these tests need root.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

import pytest

from tests.helpers.client import ping_as
from tests.helpers.harness import running_daemon
from tests.helpers.support import needs_root

MODULES = ["tests.workflows.control"]
#: A uid and gids no account uses: only setpriv gives them to the client.
UID, GID, MEMBERS = 64998, 64998, 64000

pytestmark = needs_root


def member_by_database() -> tuple[int, int, int] | None:
    """Return (uid, primary gid, group) for an account listed as a member of another group."""
    for group in grp.getgrall():
        for name in group.gr_mem:
            try:
                user = pwd.getpwnam(name)
            except KeyError:
                continue
            if user.pw_gid != group.gr_gid and user.pw_uid != 0:
                return user.pw_uid, user.pw_gid, group.gr_gid
    return None


class TestSocketGroup:
    async def test_socket_is_given_to_the_group(self, short_tmp: Path) -> None:
        """The socket the daemon binds is root:socket_group 0660: that group's members get in."""
        os.chmod(short_tmp, 0o755)  # others may reach the socket; its own mode decides
        conf = {"socket_group": MEMBERS, "allowed_groups": [MEMBERS]}
        async with running_daemon(short_tmp, MODULES, daemon=conf) as d:
            st = os.stat(d.socket)
            member = await ping_as(d.socket, UID, GID, [MEMBERS])
            stranger = await ping_as(d.socket, UID, GID, [])
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (MEMBERS, 0o660)
        assert member["ok"] is True, member
        assert stranger["error"]["code"] == "EACCES"  # the file's mode keeps it out

    async def test_unknown_group_stops_the_start(self, short_tmp: Path) -> None:
        """A socket_group name that does not exist is a config error at start (exit 2)."""
        with pytest.raises(RuntimeError, match=r"socket_group: unknown group 'no-such-grp-x'"):
            async with running_daemon(short_tmp, MODULES, daemon={"socket_group": "no-such-grp-x"}):
                pass


class TestGroupsOfTheProcess:
    async def test_supplementary_group_of_the_process_counts(self, short_tmp: Path) -> None:
        """A client holding an allowed group (that no user database lists) is served."""
        os.chmod(short_tmp, 0o777)
        conf = {"socket_mode": "0666", "allowed_groups": [MEMBERS]}
        async with running_daemon(short_tmp, MODULES, daemon=conf) as d:
            member = await ping_as(d.socket, UID, GID, [4242, MEMBERS])
            dropped = await ping_as(d.socket, UID, GID, [4242])
        assert member["ok"] is True, member
        assert dropped["error"]["code"] == "forbidden"

    async def test_dropped_groups_are_refused(self, short_tmp: Path) -> None:
        """A member by the user database that dropped the group (--clear-groups) is forbidden."""
        found = member_by_database()
        if found is None:
            pytest.skip("no account here is a listed member of a group other than its own")
        uid, gid, group = found
        os.chmod(short_tmp, 0o777)
        conf = {"socket_mode": "0666", "allowed_groups": [group]}
        async with running_daemon(short_tmp, MODULES, daemon=conf) as d:
            dropped = await ping_as(d.socket, uid, gid, [])
            kept = await ping_as(d.socket, uid, gid, [group])
            refused = [r for r in d.records() if r["event"] == "control_forbidden"]
        assert dropped["error"]["code"] == "forbidden", dropped
        assert kept["ok"] is True, kept
        assert [(r["uid"], r["gid"]) for r in refused] == [(uid, gid)]
