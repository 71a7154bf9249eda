"""Step costs kept on disk (`step_cost_store`): a second process reads what the first timed and calibrated, keys
separate shapes and models, a damaged file is a cache miss, and `auto` skips the timing when the store has the
shape."""

from __future__ import annotations

import json

import pytest
from spec_fixtures import PROMPTS, fitted_head, tiny_target

from jaxspec.engine.auto import generator as auto_generator
from jaxspec.engine.auto.config import AcceptanceProfile, StepCalibration, StepCosts
from jaxspec.engine.auto.generator import AutoSpeculativeGenerator
from jaxspec.engine.auto.step_cost_store import CALIBRATION_SECONDS, STORE_ENV, StepCostStore, cost_key, default_store
from jaxspec.engine.tree import TreeConfig
from jaxspec.errors import JaxspecError

COSTS = StepCosts(decode=0.03, verify=(0.0, 0.04, 0.05), draft=0.002)
PRIOR = AcceptanceProfile((0.5, 0.3), 100)


def test_put_then_get_round_trips_and_other_keys_miss(tmp_path):
    store = StepCostStore(tmp_path / "sub" / "costs.json")
    assert store.get("a") is None  # no file yet
    store.put("a", COSTS, {"batch": 1})
    store.put("b", StepCosts(0.1, (0.0, 0.2), 0.0), {"batch": 2})
    assert StepCostStore(store.path).get("a") == COSTS  # another reader of the same file
    assert store.get("b") == StepCosts(0.1, (0.0, 0.2), 0.0) and store.get("c") is None
    entry = json.loads(store.path.read_text())["a"]
    assert entry["what"] == {"batch": 1} and entry["timed"]
    assert not list(store.path.parent.glob("*.tmp"))  # written through a renamed temporary file
    tree = TreeConfig(4, 2, 2)
    timed = StepCosts(0.03, (0.0, 0.04, 0.05, 0.06), 0.002, ((tree, 0.004),))
    store.put("t", timed, {})
    assert store.get("t") == timed and json.loads(store.path.read_text())["t"]["tree_drafts"] == {"4,2,2": 0.004}


NEGATIVE = '{"a": {"decode": -1.0, "verify": [0.0, 1.0], "draft": 0.0}}'


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"a": {"decode": "x"}}', NEGATIVE])
def test_a_damaged_file_or_entry_is_a_miss_and_is_overwritten(tmp_path, text):
    store = StepCostStore(tmp_path / "costs.json")
    store.path.write_text(text)
    assert store.get("a") is None
    store.put("a", COSTS, {})
    assert store.get("a") == COSTS


def test_the_key_changes_with_shape_and_model_only():
    model, head = tiny_target(), fitted_head()
    key = cost_key(model, head, 1, 256, 4, None)[0]
    assert cost_key(model, head, 1, 256, 4, None)[0] == key
    others = {cost_key(model, head, 2, 256, 4, None)[0], cost_key(model, head, 1, 512, 4, None)[0],
              cost_key(model, head, 1, 256, 3, None)[0], cost_key(tiny_target(context=1024), head, 1, 256, 4, None)[0]}
    assert key not in others and len(others) == 4
    # candidate trees are part of the key; without any, the key is the one stored before trees were candidates
    assert cost_key(model, head, 1, 256, 4, None, ())[0] == key
    assert cost_key(model, head, 1, 256, 4, None, (TreeConfig(12, 5, 3),))[0] not in others | {key}


def test_the_key_follows_the_cpu_kernels_code(monkeypatch):
    """Costs timed with one version of jaxspec's CPU kernels are not reused by another: a faster kernel changes
    what a verify costs against a decode, hence auto's choice."""
    from pallas_kernels import cpu_library

    if not cpu_library.available():
        pytest.skip(f"the CPU kernels do not build here: {cpu_library.unavailable_reason()}")
    model, head = tiny_target(), fitted_head()
    key, parts = cost_key(model, head, 1, 256, 4, None)
    assert parts["cpu_kernels"] == cpu_library.sources_digest()
    monkeypatch.setattr(cpu_library, "sources_digest", lambda: "another version")
    assert cost_key(model, head, 1, 256, 4, None)[0] != key


def test_the_key_follows_how_the_head_is_held():
    """A head held on the CPU kernels (int8 panels and their scales) steps at another cost than the same head as
    plain dots: costs timed one way are not reused the other way; a head held on none keeps the key it had."""
    from flax import nnx

    from jaxspec.models.llama import hold_draft_weights

    model = tiny_target()
    head = nnx.merge(*nnx.split(fitted_head()))  # a copy: the cached head, which other tests use, stays plain
    plain_key, parts = cost_key(model, head, 1, 256, 4, None)
    assert "head_held" not in parts
    if model.numerics is None or not model.numerics.row_kernel:
        pytest.skip("the CPU row kernel does not run here")
    hold_draft_weights(head, model)
    held_key, held_parts = cost_key(model, head, 1, 256, 4, None)
    assert held_parts["head_held"] == "int8 panels, a scale per column" and held_key != plain_key


def test_default_store_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(STORE_ENV, "off")
    assert default_store() is None
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "c.json"))
    assert default_store() == StepCostStore(tmp_path / "c.json")
    monkeypatch.delenv(STORE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_store() == StepCostStore(tmp_path / "jaxspec" / "step-costs.json")


@pytest.mark.slow  # ~35 s; in CI the store's round trips and damaged files (above) and a calibration's (below)
def test_a_second_generator_reads_the_costs_the_first_timed(tmp_path, monkeypatch):
    timed = []
    real = auto_generator.measure_step_costs
    monkeypatch.setattr(auto_generator, "measure_step_costs", lambda *a: timed.append(a[2:]) or real(*a))
    store = StepCostStore(tmp_path / "costs.json")
    model, head = tiny_target(), fitted_head()

    first = AutoSpeculativeGenerator(model, head, prior=PRIOR, store=store)
    out1 = first.generate(PROMPTS[:2], max_new_tokens=8)
    buckets = len(first.step_costs)  # one timing per cache bucket the prompts fall in
    assert len(timed) == buckets and first.timing_seconds > 0
    second = AutoSpeculativeGenerator(model, head, prior=PRIOR, store=store)
    out2 = second.generate(PROMPTS[:2], max_new_tokens=8)
    assert len(timed) == buckets and second.timing_seconds == 0  # read, not timed again
    assert second.step_costs == first.step_costs
    assert [c.token_ids for c in out2] == [c.token_ids for c in out1]

    other_batch = AutoSpeculativeGenerator(model, head, prior=PRIOR, store=store, batch_size=2)
    other_batch.generate(PROMPTS[:2], max_new_tokens=8)
    assert len(timed) > buckets and all(batch == 2 for batch, _, _ in timed[buckets:])  # another shape: timed


def test_calibration_round_trips_and_a_bad_entry_is_a_miss(tmp_path):
    store = StepCostStore(tmp_path / "costs.json")
    cal = StepCalibration({0: 3.0, 1: 2.0}, {0: 4.0, 1: 1.5})
    store.put_calibration("c", cal, {})
    assert store.get_calibration("c") == cal and store.get_calibration("d") is None
    store.put("a", COSTS, {})  # another entry beside it
    assert store.get_calibration("c") == cal and store.get("a") == COSTS
    with_tree = StepCalibration({0: 3.0, TreeConfig(12, 5, 3): 2.0}, {0: 4.0, TreeConfig(12, 5, 3): 1.0})
    store.put_calibration("t", with_tree, {})
    assert store.get_calibration("t") == with_tree
    assert json.loads(store.path.read_text())["t"]["measured"] == {"0": 3.0, "tree 12,5,3": 2.0}
    for bad in ({"measured": {"0": 1.0}}, {"measured": {"0": 1.0}, "predicted": {"1": 1.0}},
                {"measured": {"0": 0.0}, "predicted": {"0": 1.0}}, {"measured": [1.0], "predicted": [1.0]}):
        store.path.write_text(json.dumps({"bad": bad}))
        assert store.get_calibration("bad") is None


def test_a_stored_calibration_weighs_a_bounded_number_of_seconds():
    cal = StepCalibration({0: 90.0, 1: 30.0}, {0: 100.0, 1: 20.0})
    light = cal.weighing_at_most(CALIBRATION_SECONDS)
    assert sum(light.measured.values()) == pytest.approx(CALIBRATION_SECONDS)
    assert light.as_dict() == cal.as_dict()  # ratios unchanged
    small = StepCalibration({0: 1.0}, {0: 2.0})
    assert small.weighing_at_most(CALIBRATION_SECONDS) == small  # already lighter
    assert StepCalibration().weighing_at_most(CALIBRATION_SECONDS) == StepCalibration()


def test_a_second_generator_starts_from_the_first_ones_calibration(tmp_path):
    store = StepCostStore(tmp_path / "costs.json")
    model, head = tiny_target(), fitted_head()
    first = AutoSpeculativeGenerator(model, head, prior=PRIOR, store=store)
    first.generate(PROMPTS[:3], max_new_tokens=8)
    assert first.calibration.measured  # every batch calibrates
    second = AutoSpeculativeGenerator(model, head, prior=PRIOR, store=store)
    assert second.calibration.as_dict() == first.calibration.as_dict()
    assert sum(second.calibration.measured.values()) <= CALIBRATION_SECONDS + 1e-9
    unstored = AutoSpeculativeGenerator(model, head, prior=PRIOR)
    assert unstored.calibration == StepCalibration()


@pytest.mark.parametrize("text", ['{"model_type": "llama"}', "[1, 2]", "not json at all"])
def test_a_file_that_is_not_a_store_is_refused_not_overwritten(tmp_path, monkeypatch, text):
    """JAXSPEC_STEP_COSTS naming some other file once overwrote it; now it is a one-line error and the file stays."""
    other = tmp_path / "config.json"
    other.write_text(text)
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", str(other))
    with pytest.raises(JaxspecError, match="is not a jaxspec step-cost store, and storing costs would overwrite it"):
        default_store()
    assert other.read_text() == text
    with pytest.raises(JaxspecError, match="is a directory"):
        StepCostStore(tmp_path)
    store = StepCostStore(tmp_path / "costs.json")
    store.put("a", COSTS, {"shape": 1})
    assert StepCostStore(store.path).get("a") == COSTS  # its own file is read back
