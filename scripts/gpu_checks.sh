#!/usr/bin/env bash
# The GPU checks, in one run on a machine with an NVIDIA GPU (the device tool's H200: torch, CuPy,
# cuda-bindings, nvidia-cufile and pytest installed, no package index). lmkv's own small
# dependencies come from ./wheels when it is there: on a machine with pip and an index,
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
#       -d wheels msgspec pydantic pydantic_core annotated-types typing-inspection typing_extensions pytest-asyncio
#   bash scripts/gpu_checks.sh [OUT_DIR]
# Writes to OUT_DIR ($OUT): env.txt (the GPU, the driver, the packages, nvidia-fs, the file systems),
# log.txt (pip, the cuFile probe, the benches' logs), pytest.log, stream-waits.txt (which calls
# make the host wait for a busy copy stream: scripts/gpu_stream_waits.py), and the JSON of
# `lmkv bench copy`, `lmkv bench gds` and `lmkv bench layerwise`. GDS_DIR picks the directory
# cuFile reads and writes (ext4 or xfs); without it the first such writable mount is taken, else
# /tmp (then the report says why GDS did not run there). GDS_UDEV_ENTRY=1: see below (the device
# tool's VM needs it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/lmkv-gpu}}
mkdir -p "$OUT"
LOG=$OUT/log.txt
: >"$LOG"
say() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
PY=${PYTHON:-python3}

say "install lmkv's dependencies"
if [ -d wheels ]; then
    # (no --no-deps: what the machine already has at a version that satisfies them stays)
    $PY -m pip install --no-index --find-links wheels msgspec pydantic pytest-asyncio >>"$LOG" 2>&1 || say "pip failed"
fi
# lmkv itself as a developer installs it (connectors, benchmarks and cuda are lmkv.* packages)
$PY -m pip install --no-index --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || say "lmkv's install failed"

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    echo "kernel: $(uname -r)"
    $PY -V
    $PY -m pip list 2>/dev/null | grep -i -E "^(torch|cupy|cuda-bindings|cuda-python|nvidia-cufile|xxhash|numpy|msgspec|pydantic) "
    echo "nvidia-fs: $(ls /proc/driver/nvidia-fs 2>&1 | tr '\n' ' ')"
    echo "cufile.json: ${CUFILE_ENV_PATH_JSON:-unset}; /etc/cufile.json: $(test -f /etc/cufile.json && echo yes || echo no)"
    echo "mounts:"
    awk '{print "  " $2 " " $3}' /proc/self/mounts
} >"$OUT/env.txt" 2>&1

if [ -z "${GDS_DIR:-}" ]; then
    GDS_DIR=$($PY - <<'EOF'
import os
from lmkv.tiers.gds import GDS_FILESYSTEMS
for line in open("/proc/self/mounts"):
    mnt, kind = line.split()[1:3]
    if kind in GDS_FILESYSTEMS and os.access(mnt, os.W_OK):
        d = os.path.join(mnt, "tmp" if mnt == "/" else "", "lmkv-gds")
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            continue
        print(d)
        break
else:
    print("/tmp/lmkv-gds")
EOF
)
fi
mkdir -p "$GDS_DIR"
say "GDS directory: $GDS_DIR"
# cuFile classifies a volume from udev's database; a VM without one gets every file refused
# (docs/guides/disk.md). GDS_UDEV_ENTRY=1 writes the entry for GDS_DIR's device where it is missing.
DEV=$(stat -c '%Hd:%Ld' "$GDS_DIR")
if [ -n "${GDS_UDEV_ENTRY:-}" ] && [ ! -e "/run/udev/data/b$DEV" ]; then
    mkdir -p /run/udev/data
    printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$(findmnt -no FSTYPE -T "$GDS_DIR")" >"/run/udev/data/b$DEV"
    say "wrote the udev entry cuFile reads: /run/udev/data/b$DEV"
fi
# what cuFile does here: lmkv's probe, then cuFile on files opened with and without O_DIRECT, to
# buffers registered or not (cuFile's own log, at INFO, comes back as cufile.log)
grep -E '"(allow_compat_mode|force_compat_mode|use_poll_mode)"' /etc/cufile.json >>"$OUT/env.txt" 2>&1
CUFILE_LOGFILE_PATH=$OUT/cufile.log CUFILE_LOGGING_LEVEL=INFO timeout 90 $PY - "$GDS_DIR" >>"$LOG" 2>&1 <<'EOF'
import os, sys, traceback
import torch
from lmkv.tiers import gds
d = sys.argv[1]
for where in (d, "/tmp"):
    print(f"probe {where} ({gds.fs_type(where)}): {gds.probe(where) or 'GDS runs'}")
print("nvidia-fs loaded:", gds.nvidia_fs_loaded())
try:
    from cuda.bindings import cufile
    print("libcufile", cufile.get_version())
    io = gds.engine(0)
    buf = torch.arange(1 << 20, dtype=torch.int32, device="cuda").to(torch.uint8)
    for direct in (True, False):
        for registered in (False, True):
            path = os.path.join(d, f"variant-{direct}-{registered}")
            fd = os.open(path, os.O_CREAT | os.O_RDWR | (os.O_DIRECT if direct else 0), 0o600)
            try:
                if registered:
                    io.register(buf.data_ptr(), buf.numel())
                io.write(fd, buf.data_ptr(), 1 << 20, 0)
                back = torch.zeros_like(buf)
                io.read(fd, back.data_ptr(), 1 << 20, 0)
                print(f"O_DIRECT={direct} registered={registered}: ok, same bytes: {torch.equal(buf, back)}")
            except Exception as err:
                print(f"O_DIRECT={direct} registered={registered}: {type(err).__name__}: {err}")
            finally:
                io.deregister(buf.data_ptr())
                os.close(fd)
                os.unlink(path)
except Exception:
    traceback.print_exc()
EOF

say "pytest"
timeout 180 $PY -m pytest -q -p no:cacheprovider -o addopts="" --basetemp "$GDS_DIR/pytest" -rs \
    tests/test_cuda_kernels.py tests/test_gpu_digests.py tests/test_gds.py tests/test_worker.py >"$OUT/pytest.log" 2>&1
say "pytest rc=$?"
tail -3 "$OUT/pytest.log" | tee -a "$LOG"
say "stream waits"
timeout 60 $PY scripts/gpu_stream_waits.py >"$OUT/stream-waits.txt" 2>&1; say "rc=$?"
grep -c WAITED "$OUT/stream-waits.txt" | sed 's/^/calls that waited: /' | tee -a "$LOG"
say "bench copy"
timeout 60 $PY -m lmkv.cli bench copy --json >"$OUT/bench-copy.json" 2>>"$LOG"; say "rc=$?"
say "bench gds"
timeout 150 $PY -m lmkv.cli bench gds --json --dir "$GDS_DIR" >"$OUT/bench-gds.json" 2>>"$LOG"; say "rc=$?"
say "bench layerwise"
timeout 120 $PY -m lmkv.cli bench layerwise --json >"$OUT/bench-layerwise.json" 2>>"$LOG"; say "rc=$?"
rm -rf "$GDS_DIR"
