#!/usr/bin/env python3
# Static SASS of the kernels in an NVRTC image (`kcompile --dump DIR` writes DIR/<module>.cubin),
# with no GPU and no CUDA toolkit: NVIDIA's disassembler ships on PyPI as a plain x86-64 binary.
#   python3 -m pip download --no-deps nvidia-cuda-nvdisasm -d /tmp/nvd
#   (cd /tmp/nvd && python3 -m zipfile -e nvidia_cuda_nvdisasm-*.whl .)
#   python3 tools/sass_stats.py --nvdisasm /tmp/nvd/nvidia/cu13/bin/nvdisasm DIR/int4.cubin 'w13_swiglu_2$'
# prints, per kernel whose name matches the regex, its instruction count (NOPs left out) and, with
# --ops, the most frequent opcodes; --dump prints the instructions. Static counts: a fully
# unrolled kernel's count is close to what a warp executes; a loop's body counts once.
import argparse, collections, re, shutil, subprocess, sys

ap = argparse.ArgumentParser()
ap.add_argument('cubin')
ap.add_argument('pattern', nargs='?', default='.')
ap.add_argument('--nvdisasm', default=shutil.which('nvdisasm') or 'nvdisasm')
ap.add_argument('--ops', action='store_true', help='the most frequent opcodes')
ap.add_argument('--dump', action='store_true', help='every instruction')
a = ap.parse_args()

try:
    out = subprocess.run([a.nvdisasm, '-c', a.cubin], capture_output=True, text=True, check=True).stdout
except (OSError, subprocess.CalledProcessError) as e:
    sys.exit(f'nvdisasm failed ({e}); give its path with --nvdisasm (see the header for where to get it)')

funcs = collections.OrderedDict()
cur = None
for line in out.splitlines():
    m = re.match(r'\s*\.text\.(\S+):', line)
    if m:
        cur = m.group(1)
        funcs[cur] = []
        continue
    m = re.match(r'\s*/\*[0-9a-f]+\*/\s+(.*?);', line)
    if m and cur:
        funcs[cur].append(m.group(1).strip())

pat = re.compile(a.pattern)
for name, ins in funcs.items():
    if not pat.search(name):
        continue
    ins = [i for i in ins if not i.startswith('NOP')]
    # Opcode without predicate and modifiers: '@!P0 LDG.E.128 ...' -> 'LDG'.
    ops = collections.Counter(re.sub(r'^@!?U?P\w+\s+', '', i).split()[0].split('.')[0] for i in ins)
    top = ' '.join(f'{k}:{v}' for k, v in ops.most_common(14)) if a.ops else ''
    print(f'{name:40s} {len(ins):6d} {top}')
    if a.dump:
        for i in ins:
            print('   ', i)
