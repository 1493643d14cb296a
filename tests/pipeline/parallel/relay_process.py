"""A TCP relay as its own process, for another local user to run between a job's processes.

`RELAY_CODE` is standard-library Python (it imports nothing of ours), run as
`python -c RELAY_CODE TARGET_PORT CAPTURE MODE`: it listens on a free port of 127.0.0.1,
prints that port, and forwards every connection's bytes both ways to TARGET_PORT, appending
each chunk to the file CAPTURE as it goes. With MODE "tamper", once the file CAPTURE.go
exists, it changes one bit in the next TLS record the server sends on each connection after
the handshake (after the client's first encrypted record: the server's whole first flight has
passed by then), as a user in the middle rewriting answers would; each change is a line of
CAPTURE.flips ("connection record-index"). MODE "once" changes one such record in all, on
the first connection to carry one (a group left alone then holds at its total until its
training_steps deadline: docs/security.md). MODE "pass" forwards every byte as it came.
"""

from __future__ import annotations

__all__ = ["RELAY_CODE"]

RELAY_CODE = r'''
import os, socket, sys, threading
target, capture, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
lock = threading.Lock()
out = open(capture, "ab", buffering=0)
flips = open(capture + ".flips", "a", buffering=1)
server = socket.create_server(("127.0.0.1", 0))
flipped_any = []
print(server.getsockname()[1], flush=True)

class Conn:
    def __init__(self, n):
        self.n, self.client_encrypted, self.flipped = n, False, False

def pipe(src, dst, conn, way):
    # TLS records: a 5-byte header (type, version, length) then the body; type 23 is an
    # encrypted record (every record after the hellos in TLS 1.3).
    header, left, index, flip_this = b"", 0, 0, False
    try:
        while True:
            chunk = bytearray(src.recv(1 << 16))
            if not chunk:
                break
            at = 0
            while at < len(chunk):
                if left == 0:
                    take = min(5 - len(header), len(chunk) - at)
                    header += bytes(chunk[at:at + take])
                    at += take
                    if len(header) == 5:
                        left, kind, header = int.from_bytes(header[3:5], "big"), header[0], b""
                        index += 1
                        if way == "up" and kind == 23:
                            conn.client_encrypted = True
                        flip_this = (way == "down" and kind == 23 and mode != "pass"
                                     and conn.client_encrypted and not conn.flipped
                                     and os.path.exists(capture + ".go"))
                        if flip_this and mode == "once":
                            with lock:  # one record in all, whichever thread comes first
                                flip_this = not flipped_any
                                flipped_any.append(conn.n)
                else:
                    take = min(left, len(chunk) - at)
                    if flip_this:
                        chunk[at] ^= 1  # the record's first byte of ciphertext
                        conn.flipped, flip_this = True, False
                        flips.write(f"{conn.n} {index}\n")
                    at += take
                    left -= take
            with lock:
                out.write(chunk)
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for s in (dst, src):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

n = 0
while True:
    client, _ = server.accept()
    try:
        upstream = socket.create_connection(("127.0.0.1", target))
    except OSError:
        client.close()
        continue
    conn, n = Conn(n), n + 1
    threading.Thread(target=pipe, args=(client, upstream, conn, "up"), daemon=True).start()
    threading.Thread(target=pipe, args=(upstream, client, conn, "down"), daemon=True).start()
'''
