import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmkv.keys import KeySpace, chain_hashes, key_hex, page_key, parse_key_hex
from lmkv.layout import attention_layout

ROOT = KeySpace("tiny-llama", "tenant-a").root
tokens = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=200)


@given(tokens, st.integers(1, 17))
@settings(max_examples=60)
def test_chain_covers_full_pages_and_is_deterministic(toks, tpp):
    a = chain_hashes(ROOT, toks, tpp)
    assert len(a) == len(toks) // tpp
    assert a == chain_hashes(ROOT, np.array(toks, dtype=np.int64), tpp)
    assert all(len(h) == 16 for h in a)


@given(tokens, tokens, st.integers(1, 8))
@settings(max_examples=60)
def test_prefix_property(a, b, tpp):
    """Pages agree exactly as long as the token prefixes up to their end agree."""
    ha, hb = chain_hashes(ROOT, a, tpp), chain_hashes(ROOT, b, tpp)
    for i, (x, y) in enumerate(zip(ha, hb)):
        assert (x == y) == (a[: (i + 1) * tpp] == b[: (i + 1) * tpp])


@given(tokens, st.integers(1, 8), st.integers(0, 10))
@settings(max_examples=40)
def test_extending_from_a_parent_equals_hashing_the_whole(toks, tpp, cut_pages):
    cut = min(cut_pages, len(toks) // tpp) * tpp
    first = chain_hashes(ROOT, toks[:cut], tpp)
    parent = first[-1] if first else ROOT
    assert first + chain_hashes(parent, toks[cut:], tpp) == chain_hashes(ROOT, toks, tpp)


def test_model_and_namespace_separate_keys():
    toks = list(range(64))
    roots = {KeySpace("m1", "a").root, KeySpace("m1", "b").root, KeySpace("m2", "a").root}
    assert len(roots) == 3
    assert len({chain_hashes(r, toks, 32)[0] for r in roots}) == 3


def test_extras_change_the_page():
    toks = list(range(64))
    plain = chain_hashes(ROOT, toks, 32)
    lora = chain_hashes(ROOT, toks, 32, extras=[b"lora:x", b""])
    assert plain[0] != lora[0] and plain[1] != lora[1]  # the chain carries it onward
    with pytest.raises(ValueError):
        chain_hashes(ROOT, toks, 32, extras=[b""])


def test_page_key_binds_layout_and_shard():
    chain = chain_hashes(ROOT, list(range(32)), 32)[0]
    base = dict(name="g", num_layers=2, tokens_per_page=32, num_kv_heads=2, head_size=64, dtype_bytes=2, dtype="bf16")
    replicated = [attention_layout(**base, tp_size=2, tp_rank=r, tp_replicas=2) for r in range(2)]
    sharded = [attention_layout(**base, tp_size=2, tp_rank=r, tp_replicas=1) for r in range(2)]
    assert page_key(chain, replicated[0]) == page_key(chain, replicated[1])
    assert page_key(chain, sharded[0]) != page_key(chain, sharded[1])
    assert page_key(chain, replicated[0]) != page_key(chain, sharded[0])
    other = attention_layout(**{**base, "head_size": 128})
    assert page_key(chain, other) != page_key(chain, attention_layout(**base))


def test_bad_tokens_and_keys():
    with pytest.raises(ValueError):
        chain_hashes(ROOT, [-1, 2], 1)
    with pytest.raises(ValueError):
        chain_hashes(ROOT, [[1, 2]], 1)
    with pytest.raises(ValueError):
        chain_hashes(b"short", [1], 1)
    k = chain_hashes(ROOT, [1, 2], 2)[0]
    assert parse_key_hex(key_hex(k)) == k
    with pytest.raises(ValueError):
        parse_key_hex("abc")
