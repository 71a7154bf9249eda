"""The process-wide bound on compiled programs: past half the memory-map limit a new compile first releases the
least recently used half of the held programs, which frees their maps; output is unchanged and a released program
compiles again when used."""

import gc

import jax
import pytest
from hf_tiny import make_tiny

from jaxspec import compiled_programs
from jaxspec.checkpoints.hf import load_target
from jaxspec.engine.generation import Generator

# prompt buckets 16, 32 and 64: two programs each (prefill, step)
PROMPTS = [[5, 17, 3, 9], [7] * 20, [11, 2] * 20]
NEW_BUCKET = [[3, 1, 4, 1, 5] * 14]  # 70 tokens: bucket 128


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny("smollm2_tied", path, seed=3)
    return load_target(path)


@pytest.fixture(autouse=True)
def own_bound(monkeypatch):
    """A process-wide order of this test's own: programs other tests left held would be dropped first."""
    monkeypatch.setattr(compiled_programs, "_BOUND", compiled_programs._Bound())


@pytest.mark.slow  # ~37 s; CI: the bench suite releases its programs after each run (test_cli)
def test_release_frees_maps_and_keeps_output(model, monkeypatch):
    want = Generator(model, batch_size=1).generate(PROMPTS + NEW_BUCKET, max_new_tokens=8)
    jax.clear_caches()  # the first generator's programs, which JAX's caches hold, go before the maps are counted
    gen = Generator(model, batch_size=1)
    first = gen.generate(PROMPTS, max_new_tokens=8)
    assert [c.token_ids for c in first] == [c.token_ids for c in want[:3]]
    held = len(gen.compiled_programs("prefill")) + len(gen.compiled_programs("step"))
    assert held == 6
    maps, releases = compiled_programs.maps_in_use(), compiled_programs.release_count()
    assert compiled_programs.held() == 6

    monkeypatch.setattr(compiled_programs, "map_limit", lambda: 1)  # every compile now finds the process past it
    new = gen.generate(NEW_BUCKET, max_new_tokens=8)
    assert new[0].token_ids == want[3].token_ids
    # the prefill's compile dropped 3 of 6, the step's 2 of 4 (never the newest two): the 128 bucket's two and one
    # older program remain
    assert compiled_programs.release_count() == releases + 2
    assert len(gen.compiled_programs("prefill")) + len(gen.compiled_programs("step")) == 3
    assert compiled_programs.maps_in_use() < maps, "released programs still hold their memory maps"

    again = gen.generate(PROMPTS, max_new_tokens=8)  # released buckets compile again
    assert [c.token_ids for c in again] == [c.token_ids for c in want[:3]]


@pytest.mark.slow
def test_no_release_below_the_limit(model, monkeypatch):
    monkeypatch.setattr(compiled_programs, "map_limit", lambda: 10**9)
    releases = compiled_programs.release_count()
    gen = Generator(model, batch_size=1)
    gen.generate(PROMPTS, max_new_tokens=4)
    assert compiled_programs.release_count() == releases
    assert len(gen.compiled_programs("prefill")) == 3


def test_a_collected_owner_leaves_the_order(model):
    gen = Generator(model, batch_size=1)
    gen.generate(PROMPTS[:1], max_new_tokens=4)
    before = compiled_programs.held()
    del gen
    gc.collect()
    assert compiled_programs.held() == before - 2


def test_a_release_keeps_the_newest_two_and_backs_off(model):
    """With only the newest two held nothing is dropped; a release that leaves the process above half its limit
    (maps held elsewhere) moves the next one to half the remaining headroom instead of releasing on every compile."""
    gen = Generator(model, batch_size=1)
    gen.generate(PROMPTS[:1], max_new_tokens=4)  # prefill + step: the newest two
    assert not compiled_programs.make_room(limit=1)
    gen.generate(PROMPTS[1:], max_new_tokens=4)  # 6 held
    maps = compiled_programs.maps_in_use()
    assert compiled_programs.make_room(limit=maps)  # at the limit: drops 3 of 6, cannot get under half of it
    assert compiled_programs.held() == 3
    assert not compiled_programs.make_room(limit=maps)  # without the back-off this would release again
