"""The GPU page digests (kernels/xxh3.cu): the kernel's own source, built for the host here, against
the xxhash package on every length class; run on a GPU where one is (the CUDA and HIP compiles
are with the copy kernel's, in test_cuda_kernels.py)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import xxhash

from lmkv.kernels.digests import digest_source

# every XXH3 length class and its edges: 0, 1-3, 4-8, 9-16, 17-128, 129-240, then stripes and blocks
LENGTHS = sorted({*range(0, 300), 383, 384, 385, 1023, 1024, 1025, 1087, 1088, 2047, 2048, 2049, 4096,
                  65535, 65536, 65537, 8192 * 3 + 5, 1 << 20})


@pytest.fixture(scope="module")
def host_xxh3(tmp_path_factory):
    """``lmkv_xxh3_64_host`` from xxh3.cu built as plain C: the functions the kernel runs, lane by lane."""
    cc = shutil.which("cc") or pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("xxh3")
    (d / "xxh3.c").write_text(digest_source())
    out = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-fno-strict-aliasing", "-Wall", "-Werror",
                          "-o", str(d / "libxxh3.so"), str(d / "xxh3.c")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    fn = ctypes.CDLL(str(d / "libxxh3.so")).lmkv_xxh3_64_host
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_uint64]
    return fn


def test_the_kernels_hash_is_xxhashs_on_every_length_and_alignment(host_xxh3):
    buf = np.random.default_rng(7).integers(0, 256, (1 << 20) + 16, dtype=np.uint8)
    for n in LENGTHS:
        for off in (0, 1, 3, 8):  # the kernel reads 8 bytes at a time only where the address allows
            data = buf[off : off + n]
            assert host_xxh3(buf.ctypes.data + off, n) == xxhash.xxh3_64_intdigest(data.tobytes()), (n, off)


def test_the_kernels_hash_of_a_page_unit_matches_the_pages_digest(host_xxh3, layout):
    """What verify_on_device compares: a unit's hash against the digest its header recorded."""
    from lmkv.page import make_header, unit_ranges

    payload = np.random.default_rng(3).integers(0, 256, layout.payload_bytes, dtype=np.uint8)
    header = make_header(b"k" * 16, layout, payload)
    for u, (a, b) in enumerate(unit_ranges(layout)):
        assert host_xxh3(payload.ctypes.data + a, b - a) == header.unit_digest(u)


def test_digest_kernel_needs_no_headers():
    assert "#include" not in digest_source()


def _gpu():
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")


def test_device_digests_are_xxhashs():
    _gpu()
    import cupy

    from lmkv.kernels.digests import device_digests

    buf = cupy.asarray(np.random.default_rng(9).integers(0, 256, (1 << 21) + 64, dtype=np.uint8))
    host = cupy.asnumpy(buf)
    rng = np.random.default_rng(10)
    cases = [(int(rng.integers(0, 64)), n) for n in LENGTHS] + [(0, 1 << 21)]
    got = cupy.asnumpy(device_digests([buf.data.ptr + off for off, _ in cases], [n for _, n in cases]))
    want = [xxhash.xxh3_64_intdigest(host[off : off + n].tobytes()) for off, n in cases]
    assert got.tolist() == want


def test_a_corrupt_page_fails_verification_on_the_device(layout):
    _gpu()
    import cupy

    from lmkv.kernels.digests import verify_on_device
    from lmkv.page import make_header

    pages = [np.random.default_rng(i).integers(0, 256, layout.payload_bytes, dtype=np.uint8) for i in range(3)]
    headers = [make_header(bytes([i]) * 16, layout, p) for i, p in enumerate(pages)]
    dev = [cupy.asarray(p) for p in pages]
    dev[1][layout.payload_bytes - 1] ^= 1  # the last byte of the last unit
    assert verify_on_device([d.data.ptr for d in dev], layout, headers) == [True, False, True]
