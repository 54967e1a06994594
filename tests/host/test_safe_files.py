"""open_untrusted: reading a file another user can replace, without following, blocking or over-reading."""
from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest

from reamer.host.safe_files import UntrustedFileError, UntrustedFileMissing, open_untrusted
from tests.conftest import IS_ROOT

ME = {os.geteuid()}


@pytest.fixture
def alarm():
    """Fail instead of hanging forever if a read blocks (a FIFO opened for reading would)."""
    def _raise(*_):
        raise TimeoutError("open_untrusted blocked")
    old = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_reads_a_regular_file_of_the_owner(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_bytes(b'{"state": "ready"}')
    assert open_untrusted(tmp_path, "status.json", ME, 1024) == b'{"state": "ready"}'
    assert open_untrusted(str(tmp_path), "status.json", ME, 1024, offset=10) == b'"ready"}'


def test_accepts_an_open_directory_fd(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"abc")
    fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        assert open_untrusted(fd, "f", ME, 10) == b"abc"
        assert open_untrusted(fd, "f", ME, 10) == b"abc"  # the caller's fd is left open
    finally:
        os.close(fd)


def test_missing_file_and_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(UntrustedFileMissing):
        open_untrusted(tmp_path, "nothing", ME, 10)
    with pytest.raises(UntrustedFileMissing):
        open_untrusted(tmp_path / "no-dir", "f", ME, 10)


def test_symlink_is_refused_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"root-only secret")
    (tmp_path / "job.log").symlink_to(secret)
    with pytest.raises(UntrustedFileError) as err:
        open_untrusted(tmp_path, "job.log", ME, 1024)
    assert err.value.reason == "link"
    assert "secret" not in str(err.value.message).replace(str(tmp_path), "")


def test_symlinked_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "f").write_bytes(b"x")
    (tmp_path / "io").symlink_to(real)
    with pytest.raises(UntrustedFileError) as err:
        open_untrusted(tmp_path / "io", "f", ME, 10)
    assert err.value.reason == "link"


def test_fifo_is_refused_without_blocking(tmp_path: Path, alarm) -> None:
    os.mkfifo(tmp_path / "events.jsonl")
    with pytest.raises(UntrustedFileError) as err:
        open_untrusted(tmp_path, "events.jsonl", ME, 1024)
    assert err.value.reason == "not_regular"
    assert "FIFO" in err.value.message


@pytest.mark.skipif(not IS_ROOT, reason="needs root to make a device node")
def test_device_is_refused_without_opening_it(tmp_path: Path, alarm) -> None:
    os.mknod(tmp_path / "status.json", 0o644 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: endless bytes
    with pytest.raises(UntrustedFileError) as err:
        open_untrusted(tmp_path, "status.json", ME, 1024)
    assert err.value.reason == "not_regular"
    assert "device" in err.value.message


def test_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "status.json").mkdir()
    with pytest.raises(UntrustedFileError) as err:
        open_untrusted(tmp_path, "status.json", ME, 1024)
    assert err.value.reason == "not_regular"


def test_socket_is_refused(tmp_path: Path, alarm) -> None:
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "s"))
    try:
        with pytest.raises(UntrustedFileError) as err:
            open_untrusted(tmp_path, "s", ME, 1024)
        assert err.value.reason == "not_regular"
    finally:
        sock.close()


def test_wrong_owner_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    others = {os.geteuid() + 12345}
    with pytest.raises(UntrustedFileError) as err:
        open_untrusted(tmp_path, "f", others, 10)
    assert err.value.reason == "wrong_owner"


@pytest.mark.skipif(not IS_ROOT, reason="needs root to chown")
def test_root_file_refused_when_only_the_user_is_expected(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"secret")
    os.chown(tmp_path / "f", 0, 0)
    with pytest.raises(UntrustedFileError) as err:
        open_untrusted(tmp_path, "f", {65534}, 10)
    assert err.value.reason == "wrong_owner"
    os.chown(tmp_path / "f", 65534, 65534)
    assert open_untrusted(tmp_path, "f", {65534}, 10) == b"secret"


def test_oversize_whole_is_refused_head_and_tail_are_capped(tmp_path: Path) -> None:
    data = bytes(range(256)) * 64  # 16 KiB
    (tmp_path / "log").write_bytes(data)
    with pytest.raises(UntrustedFileError) as err:
        open_untrusted(tmp_path, "log", ME, 1000)
    assert err.value.reason == "too_large"
    assert open_untrusted(tmp_path, "log", ME, 1000, mode="head") == data[:1000]
    assert open_untrusted(tmp_path, "log", ME, 1000, mode="head", offset=5000) == data[5000:6000]
    assert open_untrusted(tmp_path, "log", ME, 1000, mode="tail") == data[-1000:]
    assert open_untrusted(tmp_path, "log", ME, len(data)) == data  # exactly the cap is fine
    assert open_untrusted(tmp_path, "log", ME, 10, offset=len(data) - 10) == data[-10:]


def test_tail_of_a_short_file_is_the_whole_file(tmp_path: Path) -> None:
    (tmp_path / "log").write_bytes(b"one\ntwo\n")
    assert open_untrusted(tmp_path, "log", ME, 4096, mode="tail") == b"one\ntwo\n"


@pytest.mark.parametrize("name", ["", "a/b", "..", ".", "../etc"])
def test_names_that_are_not_one_component_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(UntrustedFileError) as err:
        open_untrusted(tmp_path, name, ME, 10)
    assert err.value.reason == "bad_name"


def test_hardlink_to_a_file_of_another_owner_is_refused(tmp_path: Path) -> None:
    # A hard link keeps the target's owner: the owner check catches a link to someone else's file.
    (tmp_path / "target").write_bytes(b"x")
    os.link(tmp_path / "target", tmp_path / "link")
    with pytest.raises(UntrustedFileError):
        open_untrusted(tmp_path, "link", {os.geteuid() + 1}, 10)


def test_errors_carry_a_fix(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "p")
    with pytest.raises(UntrustedFileError) as err:
        open_untrusted(tmp_path, "p", ME, 10)
    assert err.value.fix


# --- make_dir / create_file / remove_tree -------------------------------------------------------

from reamer.host.safe_files import create_file, make_dir, remove_tree  # noqa: E402


def test_make_dir_never_reuses_what_is_there(tmp_path: Path) -> None:
    make_dir(tmp_path / "d", 0o755)
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o755
    with pytest.raises(FileExistsError):
        make_dir(tmp_path / "d", 0o755)
    (tmp_path / "link").symlink_to(tmp_path / "d")
    with pytest.raises(FileExistsError):
        make_dir(tmp_path / "link", 0o755)


def test_create_file_never_writes_through_a_link(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("root's")
    (tmp_path / "job.log").symlink_to(target)
    with pytest.raises(FileExistsError):
        create_file(tmp_path, "job.log", 0o640)
    assert target.read_text() == "root's"
    fd = create_file(tmp_path, "new.log", 0o640, append=True)
    os.write(fd, b"x")
    os.close(fd)
    assert stat.S_IMODE((tmp_path / "new.log").stat().st_mode) == 0o640


@pytest.mark.skipif(not IS_ROOT, reason="needs root to hand a file to another user")
def test_make_dir_and_create_file_hand_over_to_a_user(tmp_path: Path) -> None:
    make_dir(tmp_path / "io", 0o755, 65534, 65534)
    assert (tmp_path / "io").stat().st_uid == 65534
    os.close(create_file(tmp_path, "job.log", 0o640, 65534, 65534))
    assert (tmp_path / "job.log").stat().st_uid == 65534


def test_remove_tree_removes_links_not_their_targets(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    tree = tmp_path / "job"
    (tree / "io" / "a" / "b").mkdir(parents=True)
    (tree / "io" / "a" / "b" / "f").write_text("x")
    (tree / "io" / "link-dir").symlink_to(outside)
    (tree / "io" / "a" / "link-file").symlink_to(outside / "keep")
    os.mkfifo(tree / "io" / "fifo")
    assert remove_tree(tree) == ""
    assert not tree.exists()
    assert (outside / "keep").read_text() == "keep"
    assert remove_tree(tree) == ""  # nothing there: nothing to do


def test_remove_tree_of_a_link_removes_the_link_only(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    (tmp_path / "job").symlink_to(outside)
    assert remove_tree(tmp_path / "job") == ""
    assert not (tmp_path / "job").is_symlink() and (outside / "keep").exists()


@pytest.mark.skipif(not IS_ROOT, reason="needs root: the tree belongs to another user")
def test_remove_tree_takes_a_users_tree_back_first(tmp_path: Path) -> None:
    tree = tmp_path / "job"
    (tree / "io" / "deep").mkdir(parents=True)
    for path in (tree / "io", tree / "io" / "deep"):
        os.chown(path, 65534, 65534)
        os.chmod(path, 0o777)
    (tree / "io" / "deep" / "f").write_text("x")
    assert remove_tree(tree) == ""
    assert not tree.exists()
