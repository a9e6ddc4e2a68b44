#!/usr/bin/env python3
# Compares the per-kernel machine code of two `kcompile --dump DIR` outputs (no CUDA toolkit
# needed): for every kernel in both, its .text, relocation, .nv.info (the PARAM_CBANK section
# index masked: it moves when kernels are added), .nv.shared and .nv.constant0 sections must be
# equal. Prints per module the identical, removed and added kernels; exits 1 on a difference.
# Usage: python3 tools/cubin_diff.py BEFORE_DIR AFTER_DIR
import os, struct, sys

def sections(path):
    # Parse ELF64 section headers directly.
    data = open(path, 'rb').read()
    shoff = struct.unpack_from('<Q', data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', data, 0x3A)
    hdrs = []
    for i in range(shnum):
        off = shoff + i * shentsize
        name, typ, flags, addr, offset, size = struct.unpack_from('<IIQQQQ', data, off)
        hdrs.append((name, typ, offset, size))
    stro = hdrs[shstrndx][2]
    out = {}
    for name, typ, offset, size in hdrs:
        end = data.index(b'\0', stro + name)
        n = data[stro + name:end].decode()
        out[n] = data[offset:offset + size] if typ != 8 else b'<nobits %d>' % size
    return out

def mask_info(d):
    """.nv.info with the section index of EIATTR_PARAM_CBANK (0x0a) zeroed:
    it is a symbol-table index that moves when kernels are added."""
    if d is None: return None
    out = bytearray(d); i = 0
    while i + 2 <= len(d):
        fmt, attr = d[i], d[i + 1]
        if fmt == 0x04:
            size = struct.unpack_from('<H', d, i + 2)[0]
            if attr == 0x0a: out[i + 4:i + 8] = b'\0\0\0\0'
            i += 4 + size
        elif fmt == 0x03: i += 4
        elif fmt == 0x02: i += 4
        elif fmt == 0x01: i += 2
        else: return bytes(d)
    return bytes(out)

a, b = sys.argv[1], sys.argv[2]
bad = 0
for f in sorted(os.listdir(a)):
    sa, sb = sections(os.path.join(a, f)), sections(os.path.join(b, f))
    ka = {n[len('.text.'):] for n in sa if n.startswith('.text.')}
    kb = {n[len('.text.'):] for n in sb if n.startswith('.text.')}
    same = 0
    for k in sorted(ka & kb):
        for pre in ['.text.', '.rel.text.', '.rela.text.', '.nv.info.', '.nv.shared.', '.nv.constant0.']:
            x, y = sa.get(pre + k), sb.get(pre + k)
            if pre == '.nv.info.': x, y = mask_info(x), mask_info(y)
            if x != y:
                print(f'{f}: {k}: {pre} DIFFERS'); bad += 1; break
        else:
            same += 1
    print(f'{f}: {same} identical; removed {sorted(ka - kb)}; added {sorted(kb - ka)}')
sys.exit(1 if bad else 0)
