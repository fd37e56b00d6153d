"""The shared benchmark mask zoo (magi_jax.mask_zoo): lengths, names and the masks' sizes."""

import pytest

from magi_jax import mask_zoo as mz


def test_reference_documents_sum_to_32k():
    assert len(mz.DOC_LENGTHS) == 10 and sum(mz.DOC_LENGTHS) == mz.REFERENCE_TOTAL == 32768
    assert mz.scaled_doc_lengths(32768) == list(mz.DOC_LENGTHS)
    assert mz.scaled_doc_lengths(131072) == [4 * d for d in mz.DOC_LENGTHS]


@pytest.mark.parametrize(
    "total,multiple", [(4096, 1), (16384, 128), (100000, 1), (100000, 128), (1 << 20, 128)]
)
def test_scaled_lengths_cover_the_total(total, multiple):
    lens = mz.scaled_doc_lengths(total, multiple)
    assert sum(lens) == total and min(lens) >= 1
    assert all(d % multiple == 0 for d in lens[:-1])


def test_random_lengths_are_deterministic():
    a, b = mz.random_doc_lengths(65536, 64), mz.random_doc_lengths(65536, 64)
    assert a == b and len(a) == 64 and sum(a) == 65536 and min(a) >= 1
    assert mz.random_doc_lengths(65536, 64, seed=1) != a


def test_zoo_has_every_cli_mask_over_the_total():
    z = mz.zoo(8192)
    assert tuple(z) == mz.MASKS
    for name, m in z.items():
        assert (m.total_q, m.total_k) == (8192, 8192), name
        assert 0 < m.area <= 8192 * 8192, name
    assert z["full"].area == 8192 * 8192
    assert z["doc-causal"].num_slices == 10 and z["many-docs"].num_slices == 64


def test_unknown_mask_is_rejected():
    with pytest.raises(ValueError, match="not one of"):
        mz.make_mask("no-such-mask", 4096)
