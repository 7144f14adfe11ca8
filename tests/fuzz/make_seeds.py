#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz (corpus/<target>/seed-*): a few valid framed
messages, hellos, parameter strings and bootstrap requests, and near misses, in the input
layouts that fuzz_wire.c, fuzz_params.c and fuzz_bootstrap.c document. Regression inputs (crash-*, from real bugs) are
kept by hand next to them. Run from anywhere: python3 tests/fuzz/make_seeds.py"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPE_SIZE = [1, 1, 2, 4, 8, 2, 2, 4, 8, 1]
OP_ALLREDUCE, OP_BROADCAST, OP_ALLTOALL, OP_SEND, OP_RECV = 0, 1, 7, 9, 10
MSG_MAGIC = 0x43485231
HELLO_MAGIC, ACK_MAGIC = 0x43534B48, 0x43534B41


def pad16(n):
    return (n + 15) & ~15


def msg(mode, chunk, kind, dtype, redop, algo, count, seq, root, hdr=None, payload=None):
    """mode, the 16-byte configuration of the expected op, then the stream: its header
    (the matching one unless hdr overrides fields) and payload with padding."""
    cfg = struct.pack("<BBBBBHIi", chunk, kind, dtype, redop, algo, count, seq, root)
    cfg += b"\0" * (16 - len(cfg))
    n = count * DTYPE_SIZE[dtype]
    p2p = kind in (OP_SEND, OP_RECV)
    h = dict(magic=MSG_MAGIC, seq=seq, kind=kind, dtype=dtype, redop=redop,
             flags=0 if p2p else algo, root=root, count=count, len=n)
    h.update(hdr or {})
    wire = struct.pack("<IIBBBBiQQ", h["magic"], h["seq"], h["kind"], h["dtype"], h["redop"],
                       h["flags"], h["root"], h["count"], h["len"])
    if payload is None:
        payload = bytes((i * 7) & 0xFF for i in range(n))
    wire += payload + b"\0" * (pad16(len(payload)) - len(payload))
    return bytes([mode]) + cfg + wire


def setup(nranks, rank, occupied, hello_rank, channel, hello_nranks=None, secret=None,
          version=2, ack_ok=True, stream=0, nstreams=1, chunk=0):
    cfg = bytes([nranks - 1, rank, occupied])
    secret = secret if secret is not None else bytes(0xA5 ^ i for i in range(32))
    hello = struct.pack(">II", HELLO_MAGIC, version) + secret
    hello += struct.pack(">III", hello_rank, channel, hello_nranks or nranks)
    hello += struct.pack(">III", stream, nstreams, chunk)
    ack = struct.pack(">IIIII", ACK_MAGIC if ack_ok else 0, 2, rank % 16, occupied & 1,
                      stream)
    return bytes([0x80]) + cfg + hello + ack


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


wire = {
    "allreduce-copy": msg(0, 0, OP_ALLREDUCE, 7, 0, 1, 5, 42, 0),
    "allreduce-peek-chunk7": msg(1, 7, OP_ALLREDUCE, 7, 3, 2, 5, 42, 0),
    "broadcast-root2": msg(0, 16, OP_BROADCAST, 8, 0, 0, 3, 1, 2),
    "recv-probe-tag3": msg(2, 5, OP_RECV, 0, 0, 0, 3, 0, 3),
    "recv-empty": msg(0, 0, OP_RECV, 3, 0, 0, 0, 9, -1),
    "alltoall-direct": msg(4, 0, OP_ALLTOALL, 1, 0, 0, 40, 7, 0),
    "roundtrip-small": msg(3, 9, OP_ALLREDUCE, 5, 0, 3, 11, 5, 0, payload=b"")[:17] + b"xy",
    # 64 KiB of payload: past DIRECT_MIN, so write_direct / read_direct run
    "roundtrip-direct": msg(7, 0, OP_SEND, 7, 0, 0, 16384, 3, 1, payload=b"")[:17] + b"abc",
    "mismatch-seq": msg(0, 0, OP_ALLREDUCE, 7, 0, 1, 5, 42, 0, hdr=dict(seq=43)),
    "mismatch-len": msg(0, 3, OP_RECV, 7, 0, 0, 5, 0, 1, hdr=dict(len=1 << 40)),
    "bad-magic": msg(1, 0, OP_ALLREDUCE, 7, 0, 1, 5, 42, 0, hdr=dict(magic=0x41414141)),
    "truncated": msg(0, 4, OP_ALLREDUCE, 7, 0, 1, 5, 42, 0)[:40],
    "hello-ok": setup(4, 0, 0, 2, 1),
    "hello-dup": setup(4, 0, 1 << 5, 2, 1),
    "hello-secret": setup(4, 0, 0, 2, 1, secret=b"\0" * 32),
    "hello-rank-low": setup(4, 2, 0, 1, 0, ack_ok=False),
    "hello-nranks": setup(4, 0, 0, 2, 1, hello_nranks=5),
    "hello-channel": setup(16, 3, 0, 15, 2),
    "hello-version": setup(2, 0, 0, 1, 0, version=1),
    "hello-striped": setup(4, 0, 0, 3, 0, stream=1, nstreams=4, chunk=65536),
    "hello-stream-range": setup(4, 0, 0, 3, 0, stream=4, nstreams=4, chunk=65536),
    "hello-stripe-small": setup(4, 0, 0, 3, 0, stream=0, nstreams=2, chunk=16),
}
params = {
    "int": b"\x00 -42 ",
    "int-min": b"\x01-9223372036854775808",
    "int-over": b"\x029223372036854775808",
    "size": b"\x03 4M",
    "size-kib": b"\x041 KiB",
    "size-g": b"\x0516gb",
    "bool": b"\x06true",
    "bool-off": b"\x07 OFF ",
    "algo": b"\x10allreduce:ring,tree;broadcast:^direct",
    "algo-nccl": b"\x11nvls,ring",
    "algo-bare": b"\x22Ring",
    "algo-excl": b"\x33^direct,ring;all_to_all:pairwise",
    "algo-bad": b"\x3fall_reduce:",
    "model": b"\x08net=25:2:1.5,reduce=10",
    "model-shm": b"\x09shm=::40;copy=8",
    "model-bad": b"\x2asock=1:2:0",
    "coll": b"\x0cAllReduce",
}
for k, v in wire.items():
    write("fuzz_wire", k, v)
for k, v in params.items():
    write("fuzz_params", k, v)


# fuzz_bootstrap: steps of (control byte: bit 0 client, bits 1-6 length - 1, bit 7 expire
# waiters) and bytes; requests are magic, op, keylen, timeout_ms, vallen (big endian), key,
# value.
BS_MAGIC, BS_SET, BS_GET = 0x43424B56, 1, 2


def bs_req(op, key, value=b"", timeout_ms=0, magic=BS_MAGIC, keylen=None, vallen=None):
    return struct.pack(">IIIIQ", magic, op, len(key) if keylen is None else keylen, timeout_ms,
                       len(value) if vallen is None else vallen) + key + value


def bs_steps(*parts):
    """parts: (client, bytes, expire) -> steps of at most 64 bytes each."""
    out = b""
    for client, data, expire in parts:
        for i in range(0, len(data), 64):
            chunk = data[i:i + 64]
            out += bytes([client | (len(chunk) - 1) << 1 | (0x80 if expire else 0)]) + chunk
    return out


boot = {
    "set-get": bs_steps((0, bs_req(BS_SET, b"prefix/peers", b"x" * 100), False),
                        (1, bs_req(BS_GET, b"prefix/peers", timeout_ms=1000), False)),
    "get-waits-for-set": bs_steps((1, bs_req(BS_GET, b"k", timeout_ms=5000), False),
                                  (0, bs_req(BS_SET, b"k", b"value"), False)),
    "get-expires": bs_steps((0, bs_req(BS_GET, b"missing", timeout_ms=10), True)),
    "overwrite": bs_steps((0, bs_req(BS_SET, b"a", b"1"), False),
                          (0, bs_req(BS_SET, b"a", b"22"), False),
                          (1, bs_req(BS_GET, b"a"), False)),
    "bad-magic": bs_steps((0, bs_req(BS_SET, b"a", b"1", magic=0x12345678), False)),
    "bad-keylen": bs_steps((0, bs_req(BS_GET, b"", keylen=5000), False)),
    "get-with-value": bs_steps((1, bs_req(BS_GET, b"a", b"zz"), False)),
    "huge-value-cut": bs_steps((0, bs_req(BS_SET, b"big", b"y" * 40, vallen=64 << 20), False)),
}
for k, v in boot.items():
    write("fuzz_bootstrap", k, v)
