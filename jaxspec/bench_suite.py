"""The benchmark suite behind `python -m jaxspec.bench --suite`: target-only, chains and trees over a grid of batch
sizes on one prompt set, in one process, written as JSON, a Markdown table and PNG plots.

Every method at a batch size runs on the same prompts with the same greedy settings; speed-ups are against
target-only at that batch size, and `identical_outputs` counts prompts whose speculative output equals target-only
token for token (it should be all of them: greedy speculative decoding is exact); on target-only rows after the
first batch size it counts outputs equal to the first batch size's (all of them too: batch-invariant numerics).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxspec.generation import Completion, Generator


def measure(
    gen: Generator, encoded: Sequence[Sequence[int]], max_new_tokens: int, stops, label: str | None = None
) -> tuple:
    """(completions, tokens, seconds) of one timed pass; a first batch is generated before it to compile and warm
    up (other shape buckets compile during the pass, outside the timed part of their batch). `label` names a
    progress bar."""
    gen.generate(encoded[: gen.batch_size], max_new_tokens=max_new_tokens, stop_ids=stops)
    out = gen.generate(encoded, max_new_tokens=max_new_tokens, stop_ids=stops, progress=label)
    seconds = sum(c.seconds for i, c in enumerate(out) if i % gen.batch_size == 0)
    return out, sum(c.num_generated for c in out), seconds


def speculative_stats(out: Sequence[Completion], depth: int) -> dict:
    """Mean accepted length (tokens per verify, bonus included), acceptance rate by draft position, and how many
    verify steps accepted 0..depth drafts (accepted drafts are a prefix of the path, so steps that accepted at
    least j drafts = times position j was accepted)."""
    auto = _auto_summary(out)
    out = [c for c in out if "verify_calls" in c.stats]  # automatic speculation: the batches that speculated
    if not out:
        return auto
    calls = sum(c.stats["verify_calls"] for c in out)  # raw integer counts from the engine (Generator stats)
    at_least = np.zeros((depth,), np.int64)  # chains of different lengths (automatic speculation) pad with zeros
    drafted = np.zeros((depth,), np.int64)  # per position, the verify steps that drafted it
    for c in out:
        k = len(c.stats["accepted_per_position"])
        at_least[:k] += np.asarray(c.stats["accepted_per_position"], np.int64)
        drafted[:k] += c.stats["verify_calls"]
    rates = [round(float(a) / max(int(d), 1), 3) for a, d in zip(at_least, drafted)]  # plain floats (JSON, print)
    at_least = np.concatenate([[calls], at_least, [0]]).astype(int)  # [depth + 2]
    tokens = sum(c.num_generated for c in out)
    return {
        **auto,
        "mean_accepted_length": round((tokens - len(out)) / max(calls, 1), 3),
        "acceptance_per_position": rates,
        "accepted_drafts_histogram": (at_least[:-1] - at_least[1:]).tolist(),  # steps with a = 0..depth
        "verify_steps": int(calls),
        "rejections": {k: sum(c.stats["rejections"][k] for c in out) for k in out[0].stats["rejections"]},
        "accepted_via_sibling": sum(c.stats["accepted_via_sibling"] for c in out),
    }


def _auto_summary(out: Sequence[Completion]) -> dict:
    """Automatic speculation (`stats["auto"]` of each batch): {chain length: batches that ran it} and the last
    batch's record (its choice, the costs and the running acceptance); {} for fixed methods."""
    records = [c.stats["auto"] for c in out if "auto" in c.stats]
    if not records:
        return {}
    from jaxspec.spec.auto_generator import chosen

    batch = out[0].batch_size
    return {"auto_choices": {str(k): n for k, n in chosen(out, batch).items()}, "auto_last": records[-1]}


def auto_line(run: dict) -> str:
    """What automatic speculation chose, on what it rested (a bench row with `auto_choices`)."""
    last = run["auto_last"]
    ran = ", ".join(("target-only" if k == "0" else f"K={k}") + f" × {n}" for k, n in run["auto_choices"].items())
    costs = last["step_costs_ms"] or {}
    return (
        f"auto ran {ran} (batches); last choice K={last['num_speculative_tokens']} from {last['basis']} "
        f"acceptance {last['acceptance_per_position']}, expected {last['expected_tokens_per_second']} tokens/s per "
        f"row; step costs decode {costs.get('decode')} ms, verify of 2.. tokens {costs.get('verify')} ms, head step "
        f"{costs.get('draft')} ms; running acceptance {last['running_acceptance_per_position']} over "
        f"{last['running_verify_steps']} verify steps"
    )


def rejection_table(runs: Sequence[dict]) -> list[str]:
    """Markdown rows: the share of verify steps per outcome (`jaxspec.spec.telemetry`) of each speculative run."""
    runs = [run for run in runs if "rejections" in run]
    if not runs:
        return []
    names = list(runs[0]["rejections"])
    lines = [
        "", "why verify steps stopped accepting (share of verify steps; `jaxspec.spec.telemetry`):", "",
        "| batch | method | " + " | ".join(n.replace("_", " ") for n in names) + " | accepted via a sibling |",
        "|---|---|" + "---|" * (len(names) + 1),
    ]
    for run in runs:
        calls = max(run["verify_steps"], 1)
        shares = " | ".join(f"{run['rejections'][n] / calls:.3f}" for n in names)
        lines.append(f"| {run.get('batch_size', '')} | {run['method']} | {shares} | {run['accepted_via_sibling']} |")
    return lines


def speculative_row(out, tokens: int, seconds: float, depth: int, baseline, baseline_tps: float) -> dict:
    """One speculative method's figures, against target-only on the same prompts (`baseline` completions and
    their tokens/s)."""
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 2),
        "speedup_vs_target_only": round(tokens / seconds / baseline_tps, 3),
        **speculative_stats(out, depth),
        "identical_outputs": identical(out, baseline),
    }


def identical(out: Sequence[Completion] | Sequence[Sequence[int]], baseline: Sequence[Completion]) -> str:
    """'same/total': how many outputs (completions or token lists) equal the baseline's tokens."""
    same = sum(getattr(a, "token_ids", a) == b.token_ids for a, b in zip(out, baseline))
    return f"{same}/{len(baseline)}"


def write_report(result: dict, out_dir: Path) -> list[Path]:
    """results.json, results.md and the plots; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "results.md").write_text(markdown(result) + "\n")
    return [out_dir / "results.json", out_dir / "results.md", *plot(result, out_dir)]


def markdown(r: dict) -> str:
    lines = [
        f"{r['suite']}: {r['target']} ({r['dtype']}), {r['prompts']} prompts, {r['max_new_tokens']} new tokens, "
        f"greedy; machine: {r['machine']}",
        "",
        "| batch | method | tokens/s | × target-only | mean accepted length | identical outputs |",
        "|---|---|---|---|---|---|",
    ]
    for run in r["runs"]:
        tau = run.get("mean_accepted_length", "")
        lines.append(
            f"| {run['batch_size']} | {run['method']} | {run['tokens_per_second']} | "
            f"{run.get('speedup_vs_target_only', '')} | {tau} | {run.get('identical_outputs', '')} |"
        )
    autos = [f"- batch {run['batch_size']}: {auto_line(run)}" for run in r["runs"] if "auto_last" in run]
    if autos:
        lines += ["", "automatic speculation (`--num-speculative-tokens auto`):", "", *autos]
    return "\n".join(lines + rejection_table(r["runs"]))


def plot(r: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    runs = r["runs"]
    methods = list(dict.fromkeys(run["method"] for run in runs))
    batches = sorted({run["batch_size"] for run in runs})

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        by_batch = {run["batch_size"]: run["tokens_per_second"] for run in runs if run["method"] == method}
        xs = [j + i * width for j, b in enumerate(batches) if b in by_batch]
        ax.bar(xs, [by_batch[b] for b in batches if b in by_batch], width, label=method)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(batches))], [str(b) for b in batches])
    ax.set(xlabel="batch size", ylabel="tokens/s", title=f"{r['suite']}: {r['target']}")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "tokens_per_second.png"))

    spec = [run for run in runs if "acceptance_per_position" in run and run["batch_size"] == batches[0]]
    if spec:
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in spec:
            rates = run["acceptance_per_position"]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=run["method"])
        ax.set(xlabel="draft position (tree depth)", ylabel="fraction of verify steps accepting it", ylim=(0, 1),
               title="acceptance by draft position")
        ax.legend(fontsize=8)
        paths.append(_save(fig, out_dir / "acceptance_by_position.png"))

        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.8 / len(spec)
        for i, run in enumerate(spec):
            hist = np.asarray(run["accepted_drafts_histogram"], float)
            ax.bar(np.arange(1, len(hist) + 1) + i * width, hist / hist.sum(), width, label=run["method"])
        ax.set(xlabel="tokens per verify step (accepted drafts + 1)", ylabel="fraction of steps",
               title="distribution of accepted lengths")
        ax.legend(fontsize=8)
        paths.append(_save(fig, out_dir / "accepted_lengths.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
