#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Independent encoder of kvtier's on-disk slot header v1 (format in
kvtier/kvtier_internal.h), written from the format description, not from the
C code.  Prints the golden vectors tests/test_tier_format.c compares
against and writes tests/data/tier_slot_v1.bin (two headers, 512-byte
sectors, as a slab file holds them with 0-byte payload capacity stripped)."""
import struct, sys, xxhash

def header(flags, ns_hi, ns_lo, key_hi, key_lo, length, epoch, iv, tag, psum):
    b = struct.pack("<IHHII", 0x5350564B, 1, flags, 128, 0)
    b += struct.pack("<QQQQ", ns_hi, ns_lo, key_hi, key_lo)
    b += struct.pack("<QQ", length, epoch)
    b += iv + struct.pack("<I", 0) + tag + struct.pack("<Q", psum) + bytes(16)
    assert len(b) == 120
    return b + struct.pack("<Q", xxhash.xxh3_64_intdigest(b))

payload = bytes(range(256)) * 4                        # 1024 bytes
plain = header(0, 0x0123456789ABCDEF, 0xFEDCBA9876543210, 0x1111111111111111,
               0x2222222222222222, 1024, 7, bytes(12), bytes(16),
               xxhash.xxh3_64_intdigest(payload))
enc = header(1, 1, 2, 3, 4, 65536, 0xFFFFFFFFFFFFFFFF, bytes(range(1, 13)),
             bytes(range(100, 116)), 0x5555AAAA5555AAAA)
print("payload_sum", hex(xxhash.xxh3_64_intdigest(payload)))
print("plain", plain.hex())
print("enc", enc.hex())
if len(sys.argv) > 1:
    with open(sys.argv[1], "wb") as f:
        f.write(plain + bytes(512 - 128) + enc + bytes(512 - 128))
if len(sys.argv) > 2:   # a one-slot slab image of the 4 KiB class (fuzz seed)
    with open(sys.argv[2], "wb") as f:
        f.write(plain + bytes(4096 - 128) + payload + bytes(4096 - len(payload)))
