"""`--kernels` resolution (pallas_kernels/dispatch.py): what runs for each choice on each backend."""

import pytest

from pallas_kernels import dispatch


@pytest.mark.parametrize("choice, backend, impl", [
    ("auto", "cpu", "reference"),
    ("auto", "gpu", "pallas"),  # GPUs are validated (an H200's compiled suite, 2026-11-28)
    ("auto", "tpu", "reference"),  # TPUs are not yet
    ("reference", "gpu", "reference"),
    ("pallas", "gpu", "pallas"),
    ("pallas", "tpu", "pallas"),
    ("pallas", "cpu", "interpret"),  # CPU cannot compile Pallas kernels
    ("interpret", "gpu", "interpret"),
])
def test_choices_resolve_per_backend(choice, backend, impl, monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.resolve_kernels(choice, backend) == impl
    assert dispatch.resolve_kernels(impl, backend) == impl  # resolving twice is harmless


def test_validated_backends_compile_under_auto(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "VALIDATED_BACKENDS", frozenset({"tpu"}))
    assert dispatch.resolve_kernels("auto", "tpu") == "pallas"
    assert dispatch.resolve_kernels("auto", "gpu") == "reference"
    assert "compiled for tpu" in dispatch.describe("pallas", "tpu")
    assert "not validated" not in dispatch.describe("pallas", "tpu")


def test_the_environment_sets_what_auto_means(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "pallas")
    assert dispatch.resolve_kernels(None, "cpu") == "interpret"
    assert dispatch.resolve_kernels("reference", "cpu") == "reference"  # an explicit choice wins
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="JAXSPEC_KERNELS='triton'"):
        dispatch.resolve_kernels("auto", "cpu")


def test_the_log_line_names_what_runs():
    assert "interpret mode" in dispatch.describe("interpret", "cpu")
    assert "jax.numpy references" in dispatch.describe("reference", "gpu")
    assert "not validated" in dispatch.describe("pallas", "tpu")
    assert "not validated" not in dispatch.describe("pallas", "gpu")
