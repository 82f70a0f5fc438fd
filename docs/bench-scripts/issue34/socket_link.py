"""A plain TCP socket: 25 MiB one way, then both ways at once (server or client ADDR)."""
import socket, sys, threading, time
role, addr = sys.argv[1], sys.argv[2]
N = 25 * (1 << 20)
data = b"x" * N
if role == "server":
    s = socket.create_server((addr, 29777)); c, _ = s.accept()
else:
    time.sleep(0.5); c = socket.create_connection((addr, 29777))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
def recv_all():
    got = 0
    buf = bytearray(1 << 20)
    while got < N:
        k = c.recv_into(buf); got += k
for mode in ("uni", "bi", "bi", "bi"):
    c.sendall(b"s") if role == "server" else c.recv(1)  # sync
    t = time.perf_counter()
    if mode == "uni":
        (c.sendall(data) if role == "client" else recv_all())
    else:
        th = threading.Thread(target=recv_all); th.start(); c.sendall(data); th.join()
    print(role, mode, f"{(time.perf_counter()-t)*1e3:.0f} ms", flush=True)
    if mode == "uni" and role == "client": c.recv(1)
    if mode == "uni" and role == "server": c.sendall(b"d")
