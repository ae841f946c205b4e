"""Numbered UDP datagrams across an emulated link, to see which were lost (and in what bursts).

``python -m tests.udp_sequence receive ADDR PORT SECONDS`` prints ``listening`` once its socket is bound
(start the sender after that line, or what it sends first is lost), then the sequence numbers it got, as JSON;
``python -m tests.udp_sequence send ADDR PORT COUNT RATE_PPS`` sends 0..COUNT-1, then end markers.
Both are bounded in count and time.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

END = 0xFFFFFFFF
END_MARKERS = 200


def receive(address: str, port: int, seconds: float) -> list[int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((address, port))
    sys.stdout.write("listening\n")  # bound: from here nothing sent to it is lost for want of a socket
    sys.stdout.flush()
    sock.settimeout(0.5)
    got: list[int] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            data = sock.recv(64)
        except TimeoutError:
            continue
        (seq,) = struct.unpack("!I", data[:4])
        if seq == END:
            break
        got.append(seq)
    return got


def send(address: str, port: int, count: int, rate_pps: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    start = time.monotonic()
    for seq in [*range(count), *[END] * END_MARKERS]:
        sock.sendto(struct.pack("!I", seq) + bytes(60), (address, port))
        ahead = start + seq / rate_pps - time.monotonic() if seq != END else 0.0005
        if ahead > 0:
            time.sleep(ahead)


def loss_runs(got: list[int], count: int) -> list[int]:
    """The lengths of the runs of consecutive lost datagrams."""
    received = set(got)
    runs, run = [], 0
    for seq in range(count):
        if seq in received:
            if run:
                runs.append(run)
            run = 0
        else:
            run += 1
    return runs + ([run] if run else [])


if __name__ == "__main__":
    if sys.argv[1] == "receive":
        print(json.dumps(receive(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
