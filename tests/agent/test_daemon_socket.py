"""The API socket: mode 0660, owned by the configured group, a clear error for an unknown group."""
from __future__ import annotations

import grp
import os
import stat

import pytest

from reamer.api.server import bind_unix_socket
from reamer.host.errors import ReamerError


def _some_other_group() -> grp.struct_group:
    mine = os.getegid()
    for group in grp.getgrall():
        if group.gr_gid != mine:
            return group
    pytest.skip("this host has no group other than the process's own")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown the socket to another group")
def test_socket_is_0660_and_owned_by_the_configured_group(tmp_path):
    group = _some_other_group()
    sock = bind_unix_socket(tmp_path / "r.sock", group.gr_name)
    try:
        info = os.stat(tmp_path / "r.sock")
        assert stat.S_IMODE(info.st_mode) == 0o660
        assert info.st_gid == group.gr_gid
    finally:
        sock.close()


def test_unknown_group_is_refused_with_the_fix_and_leaves_no_socket(tmp_path):
    with pytest.raises(ReamerError) as caught:
        bind_unix_socket(tmp_path / "r.sock", "no-such-group-reamer")
    assert "no-such-group-reamer" in caught.value.message and "groupadd" in caught.value.fix
    assert not (tmp_path / "r.sock").exists()
