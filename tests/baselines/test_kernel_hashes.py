"""benchmarks/kernel_hashes.py tells kernels apart by their code alone."""

from benchmarks import kernel_hashes as kh


def test_fingerprints_follow_the_kernel_code():
    """A D = 128 step lowers three kernels (forward, dQ, dK/dV). With persistent programs the
    forward and dK/dV kernels are other code, the dQ kernel (one program per unit always)
    the same, and a second lowering repeats every hash."""
    plain = kh.fingerprints(128, 0)
    persistent = kh.fingerprints(128, 132)
    assert len(plain) == len(persistent) == 3
    fwd, dq, dkv = plain
    assert persistent[1] == dq
    assert persistent[0] != fwd and persistent[2] != dkv
    assert kh.fingerprints(128, 0) == plain
