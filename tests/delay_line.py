"""A slow link for tests/hosts.py: holds every packet that reaches it for a set delay, then lets it go on.

``tc netem`` does this in the kernel, but it is not built into every kernel (this project's
machines have none: ``CONFIG_NET_SCH_NETEM`` is unset, and no module can be loaded). What
every kernel here has is TUN devices and a ``tc`` ingress filter that redirects packets
(``u32`` + ``mirred``). So ``Host.slow()`` redirects the IPv4 packets that arrive on each
end of a host's veth link to a TUN device of that end's namespace; this process, started
inside that namespace, reads them from the device, waits, and writes them back into the same
device, where the kernel receives them as if they had just come in. Each packet comes out
``delay`` plus or minus ``jitter`` after it went in, in the order it went in (like netem
without reordering: a packet never passes the one before it). Both directions of the link
get their own delay line, so a round trip takes twice the delay.

Run as ``python -m tests.delay_line DEVICE DELAY_MS JITTER_MS`` in the namespace whose
packets it delays; it prints ``ready`` once the device exists, and runs until SIGTERM.
No pytest in here: it runs as its own process.
"""

from __future__ import annotations

import fcntl
import heapq
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA  # linux/if_tun.h: _IOW('T', 202, int)
IFF_TUN = 0x0001  # IP packets, no Ethernet header
IFF_NO_PI = 0x1000  # no 4-byte packet-information prefix
MAX_PACKET = 65536


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def run(fd: int, delay_s: float, jitter_s: float) -> None:
    held: list[tuple[float, int, bytes]] = []  # (when it goes on, arrival number, packet)
    last_due = 0.0
    arrived = 0
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select([fd], [], [], timeout)
        if readable:
            packet = os.read(fd, MAX_PACKET)
            due = max(last_due, time.monotonic() + delay_s + random.uniform(-jitter_s, jitter_s))
            last_due, arrived = due, arrived + 1
            heapq.heappush(held, (due, arrived, packet))
        now = time.monotonic()
        while held and held[0][0] <= now:
            os.write(fd, heapq.heappop(held)[2])


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m tests.delay_line DEVICE DELAY_MS JITTER_MS", file=sys.stderr)
        return 2
    device, delay_ms, jitter_ms = argv[0], float(argv[1]), float(argv[2])
    if not 0 <= jitter_ms <= delay_ms:
        print(f"jitter ({jitter_ms} ms) must be between 0 and the delay ({delay_ms} ms)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    fd = open_tun(device)
    print("ready", flush=True)
    run(fd, delay_ms / 1000, jitter_ms / 1000)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
