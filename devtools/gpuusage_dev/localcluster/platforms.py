"""The CPUs the images are built for, and how this machine runs another CPU's programs.

A release's images are one index for linux/amd64 and linux/arm64 (the newest GPU nodes, Grace
CPUs, are arm64). This machine's own CPU needs nothing; another CPU's programs (its Debian
packages' scripts while the base is made, the interpreter when a build is checked) run under
qemu-user through the kernel's binfmt_misc, which Debian's qemu-user-static and binfmt-support
set up. Which CPU a program is for is read from its ELF header, never assumed.
"""

from __future__ import annotations

import platform as _platform
from pathlib import Path

from gpuusage_dev.localcluster.images import Platform

MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}
"""OCI's (Go's) architecture names → the kernel's, as `uname -m` and qemu name them."""
ELF_MACHINES = {0x3E: "amd64", 0xB7: "arm64"}
"""An ELF header's e_machine → the architecture (EM_X86_64, EM_AARCH64)."""
RELEASE_PLATFORMS = (Platform("amd64"), Platform("arm64"))


def host_platform(machine: str | None = None) -> Platform:
    """This machine's platform (`machine`: what `uname -m` says, for tests)."""
    found = machine or _platform.machine()
    for architecture, name in MACHINES.items():
        if name == found:
            return Platform(architecture)
    raise ValueError(f"images are built on {' or '.join(MACHINES.values())}, not {found}")


HOST = host_platform()


def cannot_emulate(
    platform: Platform, binfmt: Path = Path("/proc/sys/fs/binfmt_misc"), host: Platform = HOST
) -> str | None:
    """Why this machine cannot run `platform`'s programs, or None where it can."""
    if platform == host:
        return None
    machine = MACHINES.get(platform.architecture)
    if machine is None or platform.os != "linux":
        return f"images are built for {', '.join(map(str, RELEASE_PLATFORMS))}, not {platform}"
    entry = binfmt / f"qemu-{machine}"
    if not entry.is_file() or not entry.read_text().startswith("enabled"):
        return (
            f"running {platform} programs here needs qemu through binfmt_misc ({entry} is not "
            "enabled): as root, apt-get install qemu-user-static binfmt-support; mount -t "
            f"binfmt_misc binfmt_misc {binfmt} where it is not mounted; update-binfmts --enable "
            f"qemu-{machine}"
        )
    return None


def elf_architecture(data: bytes) -> str | None:
    """The architecture a 64-bit little-endian ELF file is for; None for anything else (a
    script, data, an ELF of a CPU no image is built for)."""
    if len(data) < 20 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    return ELF_MACHINES.get(int.from_bytes(data[18:20], "little"))
