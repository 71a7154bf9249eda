"""`jaxspec.bench`'s bandwidth probe and weights-only roofline, and the kernel micro-benchmark
(`python -m jaxspec.bench --kernels-micro`, jaxspec/bench/kernels.py) at tiny shapes on CPU, kernels in interpret
mode: the probe's bytes and program, the floors from the shapes, the table's rows and columns."""

from __future__ import annotations

import json
import math
import re

import jax.numpy as jnp
import pytest

from jaxspec.bench import bandwidth
from jaxspec.bench import cli as bench
from jaxspec.bench import kernels as bk
from jaxspec.errors import JaxspecError

TINY = bk.PRESETS["tiny"]


# --- the bandwidth probe ----------------------------------------------------------------------------------------------


def test_probe_is_positive_and_counts_bytes_read_and_written():
    probe = bandwidth.bandwidth_probe(1 << 20, passes=3, repeats=2)
    assert probe["buffer_bytes"] == 1 << 20 and probe["passes"] == 3
    assert probe["bytes_per_run"] == 2 * 3 * (1 << 20)  # every pass reads and writes the buffer
    assert math.isfinite(probe["gb_per_s"]) and probe["gb_per_s"] > 0
    assert probe["gb_per_s"] == pytest.approx(probe["bytes_per_run"] / probe["best_seconds"] / 1e9)
    assert "read + written" in probe["method"] and "3 in-place passes" in probe["method"]
    assert bandwidth.measure_bandwidth_gbs(1 << 16, passes=1, repeats=1) > 0


def test_probe_sizes_by_backend():
    nbytes, passes = bandwidth.probe_settings()  # this CPU
    assert nbytes == bandwidth.PROBE_MIB_CPU << 20 and passes == bandwidth.PROBE_PASSES["cpu"]
    assert bandwidth.probe_settings(5000, 7) == (4096, 7)  # whole 4 KiB pages


def test_probe_program_really_makes_every_pass():
    """The compiled program: no pass elided or fused with another (a loop of `passes` trips around one add fusion
    over the whole buffer, or that many fusions if unrolled), and the donated buffer is updated in place (no copy)."""
    n, passes = 1 << 14, 3
    x = jnp.arange(n, dtype=jnp.float32)
    hlo = bandwidth.probe_program(passes).lower(x).compile().as_text()
    buffer = rf"f32\[{n}\]"
    fusions = len(re.findall(rf"= {buffer}(\{{0\}})? fusion\(", hlo))
    loop = re.search(r"while\(.*\"known_trip_count\":\{\"n\":\"(\d+)\"\}", hlo)
    assert (loop is not None and int(loop.group(1)) == passes and fusions == 1) or (loop is None and fusions == passes)
    assert not re.search(rf"= {buffer}(\{{0\}})? copy\(", hlo)
    assert "input_output_alias" in hlo


def test_weights_roofline_says_what_it_is():
    roof = bandwidth.weights_roofline(2_000_000_000, 4, 3000.0)
    assert roof["tokens_per_second"] == pytest.approx(4 * 3000e9 / 2e9)
    assert roof["bandwidth_gb_per_s"] == 3000.0 and roof["batch_size"] == 4 and "weights-only" in roof["what"]
    assert "read + written" in roof["bandwidth_probe"]
    result = {"target": "t", "dtype": "bfloat16", "prompts": 1, "max_new_tokens": 4, "batch_size": 4,
              "machine": "m", "jaxspec": {"tokens": 4, "seconds": 1.0, "tokens_per_second": 4.0}, "roofline": roof}
    assert "| weights-only roofline (2000 MB per step at 3000.0 GB/s, copy probe) | | | 6000.0 |" in bench._table(result)


# --- floors and cases ---------------------------------------------------------------------------------------------------


def test_attention_floor_from_the_shapes():
    # Llama-3.1-8B decode at 1024 committed: K and V of 1025 slots x 8 heads x 128 x 2 bytes, q and out 32 x 128 x 2
    assert bk.attention_floor_bytes(1, 1, 1024, 32, 8, 128, 2) == 2 * 8 * 1025 * 128 * 2 + 2 * 32 * 128 * 2
    # batch 8, a 64-token verify at 16384
    assert bk.attention_floor_bytes(8, 64, 16384, 32, 8, 128, 2) == 8 * (2 * 8 * 16448 * 128 * 2 + 2 * 64 * 32 * 128 * 2)
    assert bk.floor_us(3_000_000, 3000.0) == pytest.approx(1.0)


def test_verify_floor_from_the_shapes():
    v = 128256
    assert bk.verify_floor_bytes("greedy", 8, 6, v) == 8 * 6 * v * 4  # every node's logits
    assert bk.verify_floor_bytes("tree", 8, 16, v) == 8 * v * 8  # the final p row and the noise
    assert bk.verify_floor_bytes("chain", 1, 6, v) == v * 12  # p and q rows and the noise


def test_llama_8b_cases():
    shapes = bk.PRESETS["llama-8b"]
    assert (shapes.q_heads, shapes.kv_heads, shapes.head_dim, shapes.dtype, shapes.vocab) == (
        32, 8, 128, "bfloat16", 128256)
    attention = bk.attention_cases(shapes)
    assert len(attention) == 2 * 3 * (1 + 3 * 2)  # B x L x (decode + chain and tree at T = 6, 16, 64)
    assert {c["kind"] for c in attention if c["T"] == 1} == {"decode"}
    verification = bk.verify_cases(shapes)
    # per batch: N = 6 and 16 as chains (greedy, chain) and trees (greedy, tree); N = 64 only as a tree (K ≤ 32)
    assert len(verification) == 2 * (4 + 4 + 2)
    assert {c["mode"] for c in verification} == {"greedy", "chain", "tree"}


def test_inputs_are_what_the_engine_passes():
    case = {"B": 2, "L": 100, "T": 6, "kind": "tree"}
    (q, k, v, lengths, positions, ancestors), = bk.attention_inputs(case, TINY, 64, 1)
    assert q.shape == (2, 6, TINY.q_heads, TINY.head_dim) and k.shape == v.shape == (2, TINY.kv_heads, 128, 32)
    assert ancestors.shape[:2] == (2, 6) and int(positions.min()) == 100 and int(positions.max()) <= 105
    assert (positions[:, 0] == lengths).all()  # the root sits at the committed length
    sets, depth = bk.verify_inputs({"B": 2, "N": 6, "mode": "chain", "draft": "chain K=5"}, 300, 2)
    tokens, parents, p, uniforms, noise, q_rows = sets[0]
    assert len(sets) == 2 and depth == 5 and p.shape == q_rows.shape == (2, 6, 300) and noise.shape == (2, 300)
    assert (parents[0] == jnp.arange(6) - 1).all() and (uniforms[:, 0] == 0).all() and (q_rows[:, -1] == 0).all()
    assert (tokens[:, 1:] == jnp.argmax(p, axis=-1)[:, :-1]).all()  # each draft is its parent's most likely token


# --- the run and its table ----------------------------------------------------------------------------------------------


def test_micro_run_tiny_interpret():
    attention = [{"B": 1, "L": 100, "T": 1, "kind": "decode"}]
    verification = [{"B": 1, "N": 6, "mode": "greedy", "draft": "chain K=5"}]
    r = bk.run_micro(TINY, 10.0, interpret=True, backend="cpu", repeats=1, attention=attention,
                     verification=verification)
    assert r["kernels"] == "interpret" and r["timings_meaningful"] is False
    (att,), (ver,) = r["attention"], r["verification"]
    for row in (att, ver):
        assert row["kernel_us"] > 0 and row["reference_us"] > 0 and row["same_bits"] is True
        assert row["kernel_over_reference"] == pytest.approx(row["kernel_us"] / row["reference_us"], rel=1e-2)
        assert row["floor_us"] == pytest.approx(row["floor_bytes"] / 10e9 * 1e6, rel=1e-3)
        assert row["kernel_pct_of_floor"] == pytest.approx(100 * row["floor_us"] / row["kernel_us"], rel=1e-2)
    assert att["floor_bytes"] == bk.attention_floor_bytes(1, 1, 100, 4, 2, 32, 4)
    assert ver["floor_bytes"] == bk.verify_floor_bytes("greedy", 1, 6, TINY.vocab)

    table = bk.markdown(r, "test machine", "a probe")
    assert "INTERPRET" in table and "NOT meaningful" in table
    rows = [line for line in table.splitlines() if line.startswith("|")]
    header_a, _, row_a, header_v, _, row_v = rows
    assert header_a == "| " + " | ".join(bk.ATTENTION_COLUMNS) + " |"
    assert header_v == "| " + " | ".join(bk.VERIFY_COLUMNS) + " |"
    cells = [c.strip() for c in row_a.strip("|").split("|")]
    assert len(cells) == len(bk.ATTENTION_COLUMNS) and cells[:4] == ["1", "100", "1", "decode"] and cells[-1] == "yes"
    cells = [c.strip() for c in row_v.strip("|").split("|")]
    assert len(cells) == len(bk.VERIFY_COLUMNS) and cells[:4] == ["1", "6", "greedy", "chain K=5"]


def test_a_failing_kernel_is_a_row_not_a_crash():
    def broken(*_):
        raise RuntimeError("does not lower here")

    args = [(jnp.ones(4),)]
    row = bk._measure({"kernel": broken, "reference": lambda x: x + 1}, args, 1000, 1.0, repeats=1, stream_s=0.0)
    assert row["kernel_us"] is None and "does not lower here" in row["kernel_error"] and row["reference_us"] > 0
    assert "same_bits" not in row and "kernel_over_reference" not in row
    assert bk._timed_cells(row)[0].startswith("failed (RuntimeError: does not lower here")
    row = bk._measure({"kernel": ValueError("no compiler"), "reference": lambda x: x}, args, 8, 1.0, repeats=1,
                      stream_s=0.0)  # a kernel that did not compile
    assert row["kernel_us"] is None and row["kernel_error"] == "ValueError: no compiler"


def test_cli_kernels_micro_json(capsys, monkeypatch):
    monkeypatch.setattr(bench, "measure_bandwidth_gbs", lambda: 10.0)
    code = bench.main(["--kernels-micro", "--kernel-batch", "1", "--kernel-tokens", "1", "--kernel-lengths", "70",
                       "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["shapes"]["name"] == "tiny" and r["bandwidth_gb_per_s"] == 10.0
    assert r["kernels"] == "interpret" and "read + written" in r["bandwidth_probe"]
    (row,) = r["attention"]
    assert (row["B"], row["L"], row["T"], row["kind"]) == (1, 70, 1, "decode") and row["same_bits"] is True
    assert r["verification"] == []  # no node count above 1


def test_kernel_flags_need_the_mode(tmp_path):
    args = bench.build_parser().parse_args(["--prompts-file", str(tmp_path / "p.jsonl"), "--kernel-batch", "1"])
    with pytest.raises(JaxspecError, match="--kernel-batch: for --kernels-micro only"):
        bench.check_bench_args(args)
    args = bench.build_parser().parse_args(["--kernels-micro", "--kernel-vocab", "1"])
    with pytest.raises(JaxspecError, match="--kernel-vocab must be at least 2"):
        bk.shapes_from_args(args, "cpu")
    help_text = bench.build_parser().format_help()
    assert "--kernels-micro" in help_text and "weights-only" in help_text


@pytest.mark.parametrize("shape, tied", [("llama3.1-8b", False), ("llama3.2-1b", True)])
def test_the_roofline_counts_what_a_decode_reads(shape, tied):
    """Every weight once, but not an untied model's embedding table (a step gathers rows of it)."""
    import jax
    from flax import nnx

    from jaxspec.models.llama import LlamaModel
    from jaxspec.reference_shapes import reference_config

    cfg = reference_config(shape, num_layers=1, aux_layer_ids=None)
    assert cfg.tie_word_embeddings == tied
    model = LlamaModel(cfg, dtype=jnp.bfloat16, rngs=None)  # shapes only
    every = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    table = cfg.vocab_size * cfg.hidden_size * nnx.state(model, nnx.Param)["embed_tokens"].dtype.itemsize  # held dtype
    assert bandwidth.decode_weight_bytes(model) == (every if tied else every - table)
