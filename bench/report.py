"""Results: one JSON line per arm and regime, a markdown table and a PNG chart.

``OUT/results.jsonl`` is the record; ``results.md`` and ``results.png`` are drawn
from it (the table again after every arm, so a run that dies still leaves one). Drawing
also checks the losses: within a regime, each arm's loss curve is compared step by
step with FSDP2 eager's (or, where FSDP2 eager did not run, the first arm that ran
and communicates); a difference above ``loss_rtol`` (default 2e-2, about what bf16
compute drifts over a few steps) relative to ``max(|reference|, 1)`` at any step is
marked MISMATCH in the table. An arm marked ``host_init`` (built in host memory, so from
other weights: the CPU's generator, same seed) is compared with the first such arm
(FSDP2 with ``CPUOffloadPolicy`` where it ran); no arm builds there now. The
floor trains on local gradients only, so its loss is shown but not compared.

    python -m bench.report --out DIR [--docs docs/benchmarks.md]

redraws the table and chart of DIR, and with ``--docs`` writes them into the docs.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from bench.plotting import pyplot

logger = logging.getLogger("fczero.bench")

RESULTS = "results.jsonl"
TABLE = "results.md"
CHART = "results.png"
DEFAULT_LOSS_RTOL = 2e-2
REF_ARM = "fsdp2-eager"
HOST_REF_ARM = "fsdp2-cpuoffload"  # the reference of the arms built in host memory
FLOOR_ARM = "floor"
PER_BLOCK_FLOOR_ARM = "floor-per-block"
CUDA_GRAPH_FLOOR_ARM = "floor-cudagraphs"
"""A CUDA-graph arm (name ending in ``-cudagraphs``) is compared with the floor under
CUDA graphs: both then launch their step from replayed graphs. Any other arm is compared
with the faster of the whole-model floor and the per-block one, where both ran (on some
checkpointed models compiling each block is the faster plain run)."""


def fastest_floor(arm: str, floors: dict[str, dict]) -> dict | None:
    """The floor record ``arm``'s ratio divides by, among the ``floors`` that ran."""
    if arm.endswith("-cudagraphs"):
        return floors.get(CUDA_GRAPH_FLOOR_ARM)
    plain = [floors[n] for n in (FLOOR_ARM, PER_BLOCK_FLOOR_ARM) if floors.get(n)]
    return min(plain, key=lambda r: r["step_ms"] or float("inf"), default=None)



def append_record(out_dir: Path, record: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / RESULTS, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def read_records(out_dir: Path) -> list[dict]:
    """Every record of ``results.jsonl``; a later (regime, arm) record replaces an earlier one."""
    path = out_dir / RESULTS
    if not path.exists():
        return []
    latest: dict[tuple[str, str], dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            key = (record["regime"], record["arm"])
            before = latest.get(key)
            if (
                record.get("aborted")
                and before is not None
                and before.get("aborted")
                and before.get("run_id") == record.get("run_id")
            ):  # every rank of an aborted arm wrote its own reason: keep them all
                record = {**record, "error": f"{before['error']}; {record['error']}"}
            latest[key] = record
    return list(latest.values())


def regimes_of(records: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in records:
        if r["regime"] not in seen:
            seen.append(r["regime"])
    return seen


def _arm_order(records: list[dict]) -> list[str]:
    from bench.arms import ARMS

    names = [name for name in ARMS if any(r["arm"] == name for r in records)]
    return names + sorted({r["arm"] for r in records} - set(names))


def annotate(records: list[dict]) -> list[dict]:
    """Add ``ratio_to_floor`` and the loss check (``loss_ref_arm``, ``loss_rel_diff``,
    ``loss_agrees``) to each record, per regime; returns the same dicts."""
    for regime in regimes_of(records):
        rows = [r for r in records if r["regime"] == regime]
        ok = [r for r in rows if r.get("status") == "ok"]
        floor_arms = (FLOOR_ARM, PER_BLOCK_FLOOR_ARM, CUDA_GRAPH_FLOOR_ARM)
        floors = {r["arm"]: r for r in ok if r["arm"] in floor_arms}
        refs = {}
        for host_init in (False, True):
            comparable = [
                r
                for r in ok
                if r.get("communicates", True) and r.get("host_init", False) == host_init
            ]
            ref = next((r for r in comparable if r["arm"] in (REF_ARM, HOST_REF_ARM)), None)
            if ref is None:
                ref = min(comparable, key=lambda r: r.get("order", 0), default=None)
            refs[host_init] = ref
        for r in rows:
            ref = refs[r.get("host_init", False)]
            r["ratio_to_floor"] = None
            r["loss_ref_arm"] = r["loss_rel_diff"] = r["loss_agrees"] = None
            if r.get("status") != "ok":
                continue
            floor = fastest_floor(r["arm"], floors)
            if floor is not None and floor["step_ms"]:
                r["ratio_to_floor"] = r["step_ms"] / floor["step_ms"]
            if ref is None or not r.get("communicates", True):
                continue
            rtol = r.get("loss_rtol", DEFAULT_LOSS_RTOL)
            diff = curve_difference(r, ref)
            r["loss_ref_arm"] = ref["arm"]
            r["loss_rel_diff"] = diff
            r["loss_agrees"] = bool(diff <= rtol)  # NaN compares False: a mismatch
    return records


def curve_difference(r: dict, ref: dict) -> float:
    """Largest per-step loss difference, relative to ``max(|reference loss|, 1)``.

    The whole curve is compared, not one step: the benchmark data is small, so a
    model can memorize it and drive the loss near 0, where a relative difference
    at one step means nothing. Below 1 the difference is absolute.
    """
    a = r.get("losses") or [r["loss_at_n"]]
    b = ref.get("losses") or [ref["loss_at_n"]]
    return max(abs(x - y) / max(abs(y), 1.0) for x, y in zip(a, b))


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _loss_cell(r: dict) -> str:
    if r.get("status") != "ok":
        return "-"
    loss = _f(r.get("loss_at_n"), ".4f")
    if not r.get("communicates", True):
        return f"{loss} (n/a: local grads)"
    if r.get("loss_ref_arm") is None:
        return f"{loss} (no reference)"
    if r["arm"] == r["loss_ref_arm"]:
        return f"{loss} (reference)"
    pct = 100 * r["loss_rel_diff"]
    if r["loss_agrees"]:
        return f"{loss} (ok, {pct:.2f}%)"
    return f"**{loss} MISMATCH ({pct:.2f}% vs {r['loss_ref_arm']})**"


def clip(text: str, head: int = 400, tail: int = 600) -> str:
    """The start and the end of a long message (a build log's cause is often at its end)."""
    return text if len(text) <= head + tail + 5 else f"{text[:head]} ... {text[-tail:]}"


def _short_error(r: dict, limit: int = 100) -> str:
    error = " ".join(str(r.get("error") or "").split()).replace("|", "/")
    return error if len(error) <= limit else error[: limit - 3] + "..."


def _header(records: list[dict]) -> list[str]:
    meta = records[-1].get("meta", {})
    model = meta.get("model", {})
    first = records[-1]
    date = (
        f"- date: {meta.get('date', '?')}; GPU: {meta.get('gpu', '?')}; "
        f"torch {meta.get('torch', '?')}; commit {meta.get('commit', '?')}"
    )
    impl = "Hugging Face LlamaForCausalLM, " if model.get("hf") else ""
    size = (
        f"- model: {impl}dim {model.get('dim')}, {model.get('n_layers')} layers, "
        f"{model.get('n_heads')} heads, FFN {model.get('ffn_dim')}, "
        f"vocab {model.get('vocab_size')} ({model.get('params', 0) / 1e6:.3g}M params); "
        f"{first.get('world_size')} ranks; "
        f"AdamW lr {first.get('lr')}"
    )
    timing = (
        f"- median of {first.get('steps')} timed steps after {first.get('warmup')} warm-up "
        f"(DeepCompile: 8); losses compared at every step up to {first.get('n_check')} against "
        f"{REF_ARM}, tolerance "
        f"{first.get('loss_rtol', DEFAULT_LOSS_RTOL):g} x max(|ref|, 1)"
    )
    return [date, size, timing]


def _floor_note(records: list[dict]) -> list[str]:
    """One line per floor that ``bench.run --floor-layers`` scaled to the model's depth."""
    lines = []
    for r in records:
        scaled = r.get("floor_scaled")
        if scaled and r.get("status") == "ok":
            (n0, n), (t0, t1) = scaled["layers"], scaled["step_ms"]
            lines.append(
                f"- {r['regime']} / {r['arm']}: floor scaled from {n} layers to "
                f"{scaled['full_layers']} (a line through {t0:.1f} ms at {n0} layers and "
                f"{t1:.1f} ms at {n}); its peak GiB and first step are the {n}-layer model's"
            )
    return lines


def markdown(records: list[dict]) -> str:
    """The summary table (regimes side by side) and one detailed table per regime."""
    if not records:
        return "No results yet.\n"
    annotate(records)
    regimes = regimes_of(records)
    arms = _arm_order(records)
    by_key = {(r["regime"], r["arm"]): r for r in records}
    out = ["# fczero benchmark", "", *_header(records), *_floor_note(records), "", "## Summary", ""]
    head = ["arm"]
    for g in regimes:
        head += [f"{g}: step ms", f"{g}: x floor", f"{g}: peak GiB"]
    out += ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for arm in arms:
        rows = [by_key.get((g, arm)) for g in regimes]
        label = next(r["label"] for r in rows if r is not None)
        cells = [label]
        for r in rows:
            if r is None:
                cells += ["-", "-", "-"]
            elif r.get("status") != "ok":
                cells += ["failed", "-", "-"]
            else:
                flag = "" if r.get("loss_agrees") in (True, None) else " (loss!)"
                cells += [
                    _f(r["step_ms"], ".1f") + flag,
                    _f(r["ratio_to_floor"], ".2f"),
                    _f(r.get("peak_mem_gib"), ".2f"),
                ]
        out.append("| " + " | ".join(cells) + " |")
    profiled = any(r.get("profile") for r in records)
    errors: list[str] = []
    for g in regimes:
        rows = [by_key[(g, a)] for a in arms if (g, a) in by_key]
        r0 = rows[0]
        out += ["", f"## Regime {g} ({r0['batch']} x {r0['seq_len']} per GPU)", ""]
        head = ["arm", "status", "step ms", "x floor", "tokens/s/GPU", "TFLOP/s/GPU", "peak GiB"]
        head += ["first step s", "CPU ms/step", f"loss @ step {r0.get('n_check')}"]
        if profiled:
            head += ["comm ms/step", "exposed comm ms/step", "matmul ms/step", "matmul beside comm"]
        out += ["| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (len(head) - 2)]
        for r in rows:
            ok = r.get("status") == "ok"
            status = "ok" if ok else f"FAILED: {_short_error(r)}"
            if not ok:
                message = clip(" ".join(str(r.get("error")).split())).replace("`", "'")
                errors.append(f"- {g} / {r['arm']}: `{message}`")
            prof = r.get("profile") or {}
            cells = [
                r["label"],
                status,
                _f(r.get("step_ms"), ".1f"),
                _f(r.get("ratio_to_floor"), ".3f"),
                _f(r.get("tokens_per_s_per_gpu"), ",.0f"),
                _f(r.get("tflops_per_gpu"), ".1f"),
                _f(r.get("peak_mem_gib"), ".2f"),
                _f(r.get("first_step_s"), ".1f"),
                _f(r.get("host_ms"), ".1f"),
                _loss_cell(r),
            ]
            if profiled:
                cells += [
                    _f(prof.get(key), ".1f")
                    for key in ("comm_ms", "exposed_comm_ms", "matmul_ms", "matmul_beside_comm_ms")
                ]
            out.append("| " + " | ".join(cells) + " |")
    phase_rows = phase_table(records)
    if phase_rows:
        out += ["", "## Phases (median ms per step: host issuing / GPU between events)", ""]
        out += [phase_rows.rstrip("\n")]
    if errors:
        out += ["", "## Errors", "", *errors]
    return "\n".join(out) + "\n"


def chart(records: list[dict], path: Path) -> bool:
    """Step time as a multiple of the floor and peak memory, per arm and regime; False if skipped."""
    plt = pyplot()
    if plt is None:
        return False
    annotate(records)
    regimes = regimes_of(records)
    arms = _arm_order(records)
    by_key = {(r["regime"], r["arm"]): r for r in records}
    fig, axes = plt.subplots(
        len(regimes), 2, figsize=(12, 0.5 * len(arms) * len(regimes) + 1.5), squeeze=False
    )
    for row, g in enumerate(regimes):
        rows = [by_key.get((g, a)) for a in arms]
        labels = [next(r["label"] for r in records if r["arm"] == a) for a in arms]
        for col, (key, title) in enumerate(
            (("ratio_to_floor", "step time / floor"), ("peak_mem_gib", "peak allocated GiB"))
        ):
            ax = axes[row][col]
            values = [(r or {}).get(key) if (r or {}).get("status") == "ok" else None for r in rows]
            colors = [
                "tab:red"
                if r is not None and r.get("loss_agrees") is False
                else ("tab:green" if a.startswith("fczero") else "tab:blue")
                for a, r in zip(arms, rows)
            ]
            ys = range(len(arms))
            ax.barh(ys, [v or 0.0 for v in values], color=colors)
            for y, v, r in zip(ys, values, rows):
                if r is None:
                    text = "not run"
                elif r.get("status") != "ok":
                    text = "failed"
                else:
                    text = "n/a" if v is None else f"{v:.2f}"
                ax.text(v or 0.0, y, " " + text, va="center", fontsize=8)
            ax.set_xlim(0, 1.2 * max([v for v in values if v is not None] or [1.0]))
            ax.set_yticks(list(ys), labels if col == 0 else [""] * len(arms), fontsize=8)
            ax.invert_yaxis()
            ax.set_title(f"regime {g}: {title}", fontsize=10)
            if key == "ratio_to_floor":
                ax.axvline(1.0, color="gray", linewidth=0.8, linestyle="--")
    meta = records[-1].get("meta", {})
    fig.suptitle(
        f"{meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, {meta.get('date', '?')} "
        "(red: loss mismatch)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_reports(out_dir: Path, *, draw_chart: bool = True) -> str:
    """Redraw ``results.md`` (and ``results.png``) from ``results.jsonl``; returns the markdown."""
    records = read_records(out_dir)
    text = markdown(records)
    (out_dir / TABLE).write_text(text)
    if records and draw_chart:
        chart(records, out_dir / CHART)
    return text


def write_docs(out_dir: Path, docs: Path) -> None:
    """Put OUT's table and chart into ``docs`` (``docs/benchmarks.md`` and ``benchmarks.png``).

    Reads OUT only (it may be read-only, as fetched results are)."""
    records = read_records(out_dir)
    text = markdown(records).replace("# fczero benchmark", "## Latest results", 1)
    text = text.replace("\n## ", "\n### ").replace("\n### Latest results", "\n## Latest results")
    png = docs.with_suffix(".png")
    chart_line = ""
    if records and chart(records, png):
        chart_line = f"\n![step time and peak memory per arm]({png.name})\n"
    docs.write_text(DOCS_INTRO + "\n" + text + chart_line)


DOCS_INTRO = """# Benchmarks

fczero against FSDP2, DDP, DeepSpeed and the compute-only floor, side by side. On a GPU
machine, from the repo root (DeepSpeed's wheels, if wanted, in `.whl/`):
`bash bench/gpu_run.sh` (results in `$OUT`); then
`python -m bench.report --out <that folder> --docs docs/benchmarks.md` rewrites this page.
Compare numbers only within one run: absolute times move between machines.

## How the numbers are taken

- One `torchrun` per regime, one process per GPU; the arms run one after another in the same
  processes, each built from the same seed and trained on the same synthetic tokens (each rank
  its own slice; one batch repeated, so the loss falls), memory freed between arms.
- Step time: median over the timed steps (CUDA events) after warm-up, the slowest rank's.
  x floor: step time over the floor's, same regime, same run. Peak: `max_memory_allocated` over
  the timed steps, the highest rank. First step: wall time of step 1, compilation included.
  CPU ms/step: host time inside the step call.
- Loss check: each arm's loss at step N (averaged over ranks) against FSDP2 eager's, relative
  tolerance 2e-2 (bf16 compute); a disagreeing arm is marked MISMATCH, never dropped. Every arm
  builds the model on the GPU from the same seed. The floor trains on local gradients only, so
  its loss is shown but not compared.
- An arm that fails is listed with its error; one that hangs is recorded as timed out.
- With `PROFILE=1`, each regime table adds comm ms/step and exposed comm ms/step: time collective
  kernels run with no compute kernel alongside, from a torch.profiler trace of rank 0.
- DeepSpeed (0.19.8, built from its source archive, carried as wheels in `.whl/`) is a
  benchmark-only dependency; its arms use DeepSpeed's own bf16 (params and buffers in bf16) and
  its default gradient reduction dtype.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.report", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="folder holding results.jsonl")
    parser.add_argument("--docs", type=Path, help="also write the table and chart here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.docs:
        write_docs(args.out, args.docs)
        print(args.docs.read_text())
    else:
        print(write_reports(args.out))


PHASES = ("forward", "backward", "update")
"""The phases ``bench.phases`` times, in order."""


def phase_table(records: list[dict]) -> str:
    """A markdown table of the phases of every record that has them."""
    head = ["regime", "arm"] + [f"{p}: host / GPU ms" for p in PHASES]
    rows = [head, ["---"] * 2 + ["---:"] * len(PHASES)]
    for r in records:
        phases = r.get("phases")
        if not phases:
            continue
        cells = []
        for name in PHASES:
            p = phases[name]
            gpu = p.get("gpu_ms")
            cells.append(f"{p['host_ms']:.1f} / {gpu:.1f}" if gpu is not None else f"{p['host_ms']:.1f}")
        rows.append([r["regime"], r["arm"], *cells])
    if len(rows) == 2:
        return ""
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"


if __name__ == "__main__":
    main()
