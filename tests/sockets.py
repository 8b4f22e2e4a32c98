"""Socket helpers shared by the tests that check where servers listen (Linux /proc)."""
import os
import socket


def listening(pids) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by ``pids`` (Linux /proc)."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian words
                out.append((socket.inet_ntop(family, raw), int(hexport, 16)))
    return out
