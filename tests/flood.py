"""The script of a flood: connections to a replica port that never authenticate, for the fault
tests and the soak (a stdlib-only module, so that bench/ can import it too).

Run as ``python -c FLOOD HOST PORT IDLE TRICKLING``: it prints "flooding" once its connections
are open and keeps them so (reopening each one the writer drops) until its stdin closes.
"""

from __future__ import annotations

import textwrap

FLOOD = textwrap.dedent(
    """
    # Connections to a replica port that never authenticate: some silent, some sending a byte
    # every half second; each one the writer drops is opened again, until stdin closes.
    import socket, sys, threading, time

    host, port, idle, trickling = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()

    def opened():
        while not stop.is_set():
            try:
                sock = socket.create_connection((host, port), timeout=5)
                sock.setblocking(False)
                return sock
            except OSError:
                time.sleep(0.1)

    socks = [opened() for _ in range(idle + trickling)]
    print("flooding", flush=True)
    reopened = 0
    while not stop.wait(0.5):
        for i, sock in enumerate(socks):
            if sock is None:
                continue
            try:
                if sock.recv(4096, socket.MSG_PEEK) == b"":
                    raise ConnectionError
                sock.recv(4096)
            except BlockingIOError:
                pass
            except OSError:
                sock.close()
                socks[i], reopened = opened(), reopened + 1
                continue
            if i < trickling:
                try:
                    sock.send(b"\\1")
                except OSError:
                    pass
    print("reopened", reopened, flush=True)
    """
)
