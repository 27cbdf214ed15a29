"""Random networks (tests/fuzz_networks.py): slim equals the in-place model, the live
parameter count is exact, replay is bit-identical; and merges and evictions do happen.

`make test` runs 100 seeds; `make fuzz` runs 500 (``HOPE_FUZZ_N``, ``HOPE_FUZZ_START``
choose the seeds). The coverage test reads the networks the module's checks ran in
this process and checks the ones they did not (run alone, or on another pytest-xdist
worker), so that it never skips.
"""

import os

import pytest

import fuzz_networks

N = int(os.environ.get("HOPE_FUZZ_N", "100"))
START = int(os.environ.get("HOPE_FUZZ_START", "0"))
_INFOS = {}


@pytest.mark.parametrize("seed", range(START, START + N))
def test_random_network_compress_slim_replay(seed):
    _INFOS[seed] = fuzz_networks.check(seed)


def test_the_networks_cover_every_action_and_feature():
    for seed in range(START, START + N):
        if seed not in _INFOS:
            _INFOS[seed] = fuzz_networks.check(seed)
    s = fuzz_networks.summarize([_INFOS[seed] for seed in range(START, START + N)])
    print(s)
    assert s["compressed"] >= 0.95 * N
    # Fractions of the compressed networks in which each action happened.
    assert s["prune"] >= 0.5 and s["merge"] >= 0.5 and s["evict"] >= 0.1, s
    assert s["evict_of_evictable"] >= 0.3, s
    # Fractions of the networks with each feature.
    assert s["sequential"] >= 0.1 and 0.2 <= s["conv"] <= 0.8, s
    assert s["mixed"] >= 0.1 and s["with_blocks"] >= 0.3, s
