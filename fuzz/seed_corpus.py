#!/usr/bin/env python3
"""Seed fuzz/corpus/<target>/ from the golden captures (../shared/golden beside the repository).

ib_packet gets UDP payloads (IB packets), roce gets IP packets, capture gets small pcap files made
of a few frames each, grh_lrh gets synthetic LRH+BTH and GRH+BTH prefixes, cm and cm_agent get
the CM MADs of the captures (UD packets to QP 1). The corpus directory is
git-ignored; run this before `cargo fuzz run`.
"""
import glob, os, struct, sys

here = os.path.dirname(os.path.abspath(__file__))
golden = os.path.join(here, "..", "..", "shared", "golden")
out = os.path.join(here, "corpus")

def frames(path):
    d = open(path, "rb").read()
    off = 24
    while off + 16 <= len(d):
        _, _, incl, _ = struct.unpack("<IIII", d[off:off + 16])
        yield d[off + 16:off + 16 + incl]
        off += 16 + incl

def put(target, name, data):
    os.makedirs(os.path.join(out, target), exist_ok=True)
    with open(os.path.join(out, target, name), "wb") as f:
        f.write(data)

for path in sorted(glob.glob(os.path.join(golden, "*.pcap"))):
    base = os.path.basename(path)[:-5]
    seen_ops = set()
    kept = []
    for i, f in enumerate(frames(path)):
        if len(f) < 14 + 28:
            continue
        et = struct.unpack(">H", f[12:14])[0]
        if et == 0x0800 and f[23] == 17:
            ihl = (f[14] & 15) * 4
            ip, udp_at = f[14:], ihl
        elif et == 0x86dd and f[20] == 17:
            ip, udp_at = f[14:], 40
        else:
            continue
        if struct.unpack(">H", ip[udp_at + 2:udp_at + 4])[0] != 4791:
            continue
        op = ip[udp_at + 8]
        ib = ip[udp_at + 8:]
        # A UD packet to QP 1 (BTH, DETH, MAD, ICRC): a CM MAD, for the cm targets.
        if op == 0x64 and len(ib) >= 20 + 256 + 4 and ib[5:8] == b"\x00\x00\x01":
            mad = ib[20:20 + 256]
            put("cm", f"{base}-{i}", mad)
            # cm_agent reads 33-byte chunks: an operation byte, then 32 bytes. Operation 2
            # delivers the bytes as a MAD; chunks of operation 0 XOR bytes into the peer's next.
            put("cm_agent", f"{base}-{i}", bytes([2]) + mad[:32] + bytes([6]) + bytes(32) + bytes([1]) + bytes(32))
        if op in seen_ops:
            continue
        seen_ops.add(op)
        kept.append(f)
        put("roce", f"{base}-{i}", ip)
        put("ib_packet", f"{base}-{i}", ip[udp_at + 8:])
    if kept:
        hdr = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1)
        recs = b"".join(struct.pack("<IIII", 0, 0, len(f), len(f)) + f for f in kept[:4])
        put("capture", base, hdr + recs)
        put("grh_lrh", base + "-local", bytes([0, 2, 0, 2, 0, 9, 0, 1]) + kept[0][-20:])
        put("grh_lrh", base + "-global", bytes([0, 3, 0, 2, 0, 9, 0, 1]) + bytes([0x60]) + bytes(39) + kept[0][-20:])
print("corpus written to", out)
