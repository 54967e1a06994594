"""systemd as the owner of cgroups: AllowedCPUs= of a unit at runtime, transient scopes for loose processes.

Talks to PID 1 over the system D-Bus (jeepney), the way `systemctl set-property --runtime` and
`systemd-run --scope` do, so systemd's view of a unit and the kernel's cgroup files agree.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from reamer.host.cpulist import format_cpulist
from reamer.host.errors import HostError

UNIT_SUFFIXES = (".service", ".scope", ".slice")
SLICE = "reamer.slice"
DBUS_TIMEOUT_S = 30.0
_MANAGER = ("/org/freedesktop/systemd1", "org.freedesktop.systemd1", "org.freedesktop.systemd1.Manager")
_UNIT_INTERFACES = {".service": "org.freedesktop.systemd1.Service", ".scope": "org.freedesktop.systemd1.Scope",
                    ".slice": "org.freedesktop.systemd1.Slice"}
_VALID_UNIT = re.compile(r"^[A-Za-z0-9:_.\\@-]+$")


def systemd_booted(run_root: str | Path = "/run") -> bool:
    """sd_booted(): PID 1 is systemd (it creates /run/systemd/system early at boot)."""
    return (Path(run_root) / "systemd" / "system").is_dir()


def unit_of_cgroup(path: str) -> str | None:
    """The systemd unit a cgroup path names by its last segment ("system.slice/docker-ab.scope" ->
    "docker-ab.scope"), or None when the cgroup is not a unit's own (cgroupfs-driver paths, sub-cgroups)."""
    last = path.strip("/").rsplit("/", 1)[-1]
    return last if last.endswith(UNIT_SUFFIXES) and _VALID_UNIT.match(last) else None


def cpu_mask(cpus: Iterable[int]) -> bytes:
    """AllowedCPUs= on D-Bus: a little-endian bitmask, one bit per CPU (empty = no restriction)."""
    wanted = sorted(set(cpus))
    if not wanted:
        return b""
    mask = bytearray(wanted[-1] // 8 + 1)
    for cpu in wanted:
        mask[cpu // 8] |= 1 << (cpu % 8)
    return bytes(mask)


def mask_cpus(mask: bytes) -> list[int]:
    return [index * 8 + bit for index, byte in enumerate(mask) for bit in range(8) if byte >> bit & 1]


@dataclass
class UnitState:
    name: str
    active: str  # ActiveState: active, inactive, failed, ...
    allowed_cpus: list[int]  # [] = no restriction


class Systemd:
    """The system manager over D-Bus. One connection, opened on first use."""

    def __init__(self) -> None:
        self._connection: Any = None

    def _conn(self) -> Any:
        if self._connection is None:
            try:
                from jeepney.io.blocking import open_dbus_connection
                self._connection = open_dbus_connection(bus="SYSTEM")
            except (OSError, ConnectionError, KeyError) as error:
                raise HostError(f"cannot reach systemd on the system D-Bus: {error}",
                                "start dbus (systemctl start dbus), or run reamer on a host without systemd "
                                "cgroup management") from None
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _call(self, path: str, interface: str, method: str, signature: str, body: tuple, what: str) -> tuple:
        from jeepney import DBusAddress, DBusErrorResponse, new_method_call
        from jeepney.wrappers import unwrap_msg

        address = DBusAddress(path, bus_name=_MANAGER[1], interface=interface)
        try:
            reply = self._conn().send_and_get_reply(new_method_call(address, method, signature, body),
                                                    timeout=DBUS_TIMEOUT_S)
            return unwrap_msg(reply)
        except DBusErrorResponse as error:
            raise HostError(f"systemd refused to {what}: {error.name}: {' '.join(map(str, error.data))}",
                            "see `journalctl -u init.scope` and `systemctl status` of the unit") from None
        except (OSError, TimeoutError) as error:
            self.close()
            raise HostError(f"systemd did not answer while trying to {what}: {error}",
                            "check that systemd and dbus are healthy (systemctl is-system-running)") from None

    def _manager(self, method: str, signature: str, body: tuple, what: str) -> tuple:
        return self._call(_MANAGER[0], _MANAGER[2], method, signature, body, what)

    def unit_path(self, unit: str) -> str | None:
        try:
            return self._manager("GetUnit", "s", (unit,), f"find unit {unit}")[0]
        except HostError as error:
            if "NoSuchUnit" in error.message:
                return None
            raise

    def unit_state(self, unit: str) -> UnitState | None:
        path = self.unit_path(unit)
        if path is None:
            return None
        props = "org.freedesktop.DBus.Properties"
        active = self._call(path, props, "Get", "ss", ("org.freedesktop.systemd1.Unit", "ActiveState"),
                            f"read {unit}'s state")[0][1]
        interface = _UNIT_INTERFACES.get(Path(unit).suffix)
        allowed: list[int] = []
        if interface:
            allowed = mask_cpus(bytes(self._call(path, props, "Get", "ss", (interface, "AllowedCPUs"),
                                                 f"read {unit}'s AllowedCPUs")[0][1]))
        return UnitState(unit, str(active), allowed)

    def set_allowed_cpus(self, unit: str, cpus: Iterable[int]) -> None:
        """`systemctl set-property --runtime UNIT AllowedCPUs=...` ([] = no restriction)."""
        cpus = sorted(set(cpus))
        self._manager("SetUnitProperties", "sba(sv)", (unit, True, [("AllowedCPUs", ("ay", cpu_mask(cpus)))]),
                      f"set AllowedCPUs={format_cpulist(cpus) or '(none)'} on {unit}")

    def start_scope(self, unit: str, pids: list[int], cpus: Iterable[int], description: str,
                    timeout: float = DBUS_TIMEOUT_S) -> None:
        """`systemd-run --scope --slice=reamer.slice -p AllowedCPUs=...` for processes already running:
        systemd moves them into a new scope unit of their own. Returns once the scope is active."""
        properties = [("PIDs", ("au", list(pids))), ("Slice", ("s", SLICE)), ("Description", ("s", description)),
                      ("AllowedCPUs", ("ay", cpu_mask(cpus))), ("CollectMode", ("s", "inactive-or-failed"))]
        self._manager("StartTransientUnit", "ssa(sv)a(sa(sv))", (unit, "fail", properties, []),
                      f"start scope {unit} for pids {pids}")
        deadline = time.monotonic() + timeout
        while True:
            state = self.unit_state(unit)
            if state is not None and state.active == "active":
                return
            if time.monotonic() > deadline:
                raise HostError(f"scope {unit} did not become active within {timeout:.0f} s",
                                f"see `systemctl status {unit}`")
            time.sleep(0.05)

    def attach_processes(self, unit: str, pids: list[int], subcgroup: str = "") -> None:
        """Move processes into a unit's cgroup (or a sub-cgroup of it) through systemd."""
        self._manager("AttachProcessesToUnit", "ssau", (unit, subcgroup, list(pids)),
                      f"move pids {pids} back into {unit}")
