import numpy as np
import pytest
from conftest import random_payload
from hypothesis import given, settings
from hypothesis import strategies as st

from lmkv.errors import ChecksumError, PageFormatError, ShortReadError
from lmkv.layout import GroupLayout
from lmkv.page import (
    FIXED_BYTES,
    make_header,
    unit_ranges,
    units_in_ranges,
    units_of_layers,
    unpack_header,
    verify_payload,
    verify_units,
)

KEY = bytes(range(16))


def test_header_roundtrip(layout):
    p = random_payload(layout)
    h = make_header(KEY, layout, p)
    assert h.num_units == 8 and h.header_bytes == FIXED_BYTES + 64
    again = unpack_header(h.pack(), expect_key=KEY, layout=layout)
    assert again == h
    verify_payload(again, layout, p)


@given(st.data())
@settings(max_examples=80, deadline=None)
def test_any_flipped_payload_bit_is_caught(data):
    from lmkv.layout import attention_layout

    lay = attention_layout("g", 3, 16, 1, 64, 2, "bf16")
    p = random_payload(lay, 1)
    h = make_header(KEY, lay, p)
    pos = data.draw(st.integers(0, len(p) - 1))
    bit = data.draw(st.integers(0, 7))
    bad = p.copy()
    bad[pos] ^= 1 << bit
    with pytest.raises(ChecksumError, match="layer"):
        verify_payload(h, lay, bad)


@given(st.data())
@settings(max_examples=80, deadline=None)
def test_any_flipped_header_bit_is_caught(data):
    from lmkv.layout import attention_layout

    lay = attention_layout("g", 2, 16, 1, 64, 2, "bf16")
    packed = bytearray(make_header(KEY, lay, random_payload(lay)).pack())
    pos = data.draw(st.integers(0, len(packed) - 1).filter(lambda i: not 6 <= i < 8 and not 56 <= i < 64))
    packed[pos] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises((PageFormatError, ChecksumError, ShortReadError)):
        unpack_header(bytes(packed), expect_key=KEY, layout=lay)


def test_wrong_key_layout_and_truncation(layout, mamba_layout):
    h = make_header(KEY, layout, random_payload(layout))
    with pytest.raises(PageFormatError, match="expected"):
        unpack_header(h.pack(), expect_key=bytes(16), layout=layout)
    with pytest.raises(PageFormatError, match="layout"):
        unpack_header(h.pack(), layout=mamba_layout)
    with pytest.raises(ShortReadError):
        unpack_header(h.pack()[:40])
    with pytest.raises(ShortReadError):
        unpack_header(h.pack()[:-1])
    with pytest.raises(PageFormatError, match="magic"):
        unpack_header(b"XXXX" + h.pack()[4:])
    with pytest.raises(ShortReadError):
        verify_payload(h, layout, random_payload(layout)[:-5])
    with pytest.raises(ValueError):
        make_header(KEY, layout, random_payload(layout)[:-1])


def test_layerwise_verification_checks_only_the_layers_read(layout):
    p = random_payload(layout)
    h = make_header(KEY, layout, p)
    out = np.zeros_like(p)
    s, e = layout.layer_range(1)
    out[s:e] = p[s:e]
    verify_units(h, layout, out, units_of_layers(layout, [1]))  # other layers are zeros: fine
    with pytest.raises(ChecksumError, match="layer 2"):
        verify_units(h, layout, out, units_of_layers(layout, [2]))


def test_units_in_ranges(layout):
    assert list(units_in_ranges(layout, [layout.layer_range(0), layout.layer_range(3, 1)])) == [0, 1, 7]
    s, e = layout.layer_range(1)
    assert units_in_ranges(layout, [(s, layout.layer_range(2)[1])]) == range(2, 6)  # (a run: one comparison)
    with pytest.raises(ValueError):
        units_in_ranges(layout, [(s + 1, e)])
    with pytest.raises(ValueError):
        units_in_ranges(layout, [(s, e - 1)])
    assert len(unit_ranges(layout)) == 8


def test_mamba_units(mamba_layout: GroupLayout):
    p = random_payload(mamba_layout)
    h = make_header(KEY, mamba_layout, p)
    assert h.num_units == 6
    verify_payload(h, mamba_layout, p)


def test_a_run_of_units_is_checked_at_once_and_a_bad_unit_in_it_is_still_named(layout):
    p = random_payload(layout)
    h = make_header(KEY, layout, p)
    whole = units_in_ranges(layout, [(0, layout.payload_bytes)])
    assert whole == range(h.num_units)
    verify_units(h, layout, p, whole)
    s, _ = layout.layer_range(2)
    p[s] ^= 1
    for units in (whole, list(whole), tuple(whole), iter(whole)):
        with pytest.raises(ChecksumError, match="layer 2"):
            verify_units(h, layout, p, units)
    # units out of order are checked one by one: a run's digests in another order do not pass
    q = random_payload(layout)
    hq = make_header(KEY, layout, q)
    a, b = layout.layer_range(0)
    c, d = layout.layer_range(1)
    swapped = q.copy()
    swapped[a:b], swapped[c:d] = q[c:d], q[a:b]
    with pytest.raises(ChecksumError):
        verify_units(hq, layout, swapped, [2, 3, 0, 1])
