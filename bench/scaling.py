"""Weak scaling: the same arms and per-GPU batch at several world sizes, side by side.

    python -m bench.scaling out/scale/n2 out/scale/n8 --out out/scale/scaling
    python -m bench.scaling OUT2 OUT4 OUT8 --out DIR --peak-tflops 989.4

Each folder is one ``bench.run`` output (its ``results.jsonl``); every record carries its
world size (``world_size``), so the folders may come in any order. Per regime, one row per
arm and world size:

- tokens/s/GPU (``tokens_per_s_per_gpu``: per-GPU batch x sequence over the step time);
- weak-scaling efficiency: tokens/s/GPU at N over the same arm's at the smallest world size
  of the set (1.00 there; "-" where the arm did not run at the smallest size);
- MFU: model TFLOP/s per GPU (``tflops_per_gpu``, no recomputation counted) over the GPU's
  dense bf16 peak, looked up from the GPU's name (``PEAK_BF16_TFLOPS``) or ``--peak-tflops``;
- peak GiB: ``max_memory_allocated``, the highest rank.

Writes ``DIR/scaling.md``, ``DIR/scaling.json`` (the rows) and, where matplotlib imports,
``DIR/scaling.png`` (tokens/s/GPU and efficiency against the world size).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from bench import report
from bench.plotting import pyplot

logger = logging.getLogger("fczero.bench")

TABLE = "scaling.md"
ROWS = "scaling.json"
CHART = "scaling.png"

PEAK_BF16_TFLOPS: tuple[tuple[str, float | None], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", None),  # not looked up: pass --peak-tflops
    ("H100", 989.4),
    ("H200", 989.4),
    ("A100", 312.0),
)
"""Dense bf16 tensor-core peak per GPU (no sparsity), by the first marker in the GPU's name
(``torch.cuda.get_device_name``); SXM parts unless the name says otherwise."""


def peak_tflops_of(gpu: str) -> float | None:
    """The dense bf16 peak of the GPU ``meta["gpu"]`` names ("8 x NVIDIA H100 80GB HBM3")."""
    for marker, tflops in PEAK_BF16_TFLOPS:
        if marker in gpu:
            return tflops
    return None


def load(folders: list[Path]) -> list[dict]:
    """Every record of every folder; a later folder's (regime, arm, world size) replaces an earlier's."""
    latest: dict[tuple[str, str, int], dict] = {}
    for folder in folders:
        records = report.read_records(folder)
        if not records:
            raise SystemExit(f"no records in {folder / report.RESULTS}: is it a bench.run output?")
        for r in records:
            key = (r["regime"], r["arm"], r["world_size"])
            if key in latest:
                logger.warning("%s at %d ranks twice: %s replaces the earlier", *key[:2], key[2],
                               folder)  # fmt: skip
            latest[key] = {**r, "source": str(folder)}
    return list(latest.values())


def rows_of(records: list[dict], *, peak_tflops: float | None = None) -> list[dict]:
    """One row per regime, arm and world size (in bench.arms order, smallest world first)."""
    by_key = {(r["regime"], r["arm"], r["world_size"]): r for r in records}
    sizes = sorted({r["world_size"] for r in records})
    rows = []
    for regime in report.regimes_of(records):
        for arm in report._arm_order([r for r in records if r["regime"] == regime]):
            base = by_key.get((regime, arm, sizes[0]))
            base_tps = base.get("tokens_per_s_per_gpu") if _ok(base) else None
            for n in sizes:
                r = by_key.get((regime, arm, n))
                if r is None:
                    continue
                ok = _ok(r)
                tps = r.get("tokens_per_s_per_gpu") if ok else None
                peak = peak_tflops or peak_tflops_of(r.get("meta", {}).get("gpu", ""))
                tflops = r.get("tflops_per_gpu") if ok else None
                rows.append({
                    "regime": regime, "arm": arm, "label": r["label"], "world_size": n,
                    "status": "ok" if ok else "failed", "batch": r.get("batch"),
                    "seq_len": r.get("seq_len"), "step_ms": r.get("step_ms") if ok else None,
                    "tokens_per_s_per_gpu": tps,
                    "efficiency": tps / base_tps if tps and base_tps else None,
                    "tflops_per_gpu": tflops,
                    "mfu": tflops / peak if tflops is not None and peak else None,
                    "peak_mem_gib": r.get("peak_mem_gib") if ok else None,
                    "floor_scaled": r.get("floor_scaled"), "gpu": r.get("meta", {}).get("gpu"),
                    "source": r.get("source"),
                })  # fmt: skip
    return rows


def _ok(r: dict | None) -> bool:
    return r is not None and r.get("status") == "ok"


def markdown(rows: list[dict], records: list[dict]) -> str:
    """The sources, then one table per regime: each arm at each world size."""
    sizes = sorted({r["world_size"] for r in rows})
    out = ["# fczero weak scaling", ""]
    for n in sizes:
        r = next(r for r in records if r["world_size"] == n)
        meta, model = r.get("meta", {}), r.get("meta", {}).get("model", {})
        out.append(
            f"- {n} ranks: {meta.get('gpu', '?')}; torch {meta.get('torch', '?')}; commit "
            f"{meta.get('commit', '?')}; {meta.get('date', '?')}; model "
            f"{model.get('params', 0) / 1e9:.3g}B params, {model.get('n_layers')} layers; "
            f"from {r.get('source')}"
        )
    out.append(
        f"- efficiency: tokens/s/GPU over the same arm's at {sizes[0]} ranks (same per-GPU "
        "batch); MFU: model TFLOP/s per GPU (no recomputation) over the GPU's dense bf16 peak"
    )
    for regime in dict.fromkeys(r["regime"] for r in rows):
        mine = [r for r in rows if r["regime"] == regime]
        shapes = sorted({(r["batch"], r["seq_len"]) for r in mine}, key=str)
        shape = ", ".join(f"{b} x {t}" for b, t in shapes)
        out += ["", f"## Regime {regime} ({shape} per GPU)", ""]
        if len(shapes) > 1:
            out += ["**The per-GPU batch differs between the runs: not weak scaling.**", ""]
        head = ["arm", "GPUs", "step ms", "tokens/s/GPU", f"efficiency vs {sizes[0]}", "MFU",
                "peak GiB"]  # fmt: skip
        out += ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
        for r in mine:
            label = r["label"] if r["status"] == "ok" else f"{r['label']} (failed)"
            out.append("| " + " | ".join([
                label, str(r["world_size"]), _f(r["step_ms"], ".1f"),
                _f(r["tokens_per_s_per_gpu"], ",.0f"), _f(r["efficiency"], ".3f"),
                _f(None if r["mfu"] is None else 100 * r["mfu"], ".1f", "%"),
                _f(r["peak_mem_gib"], ".2f"),
            ]) + " |")  # fmt: skip
    scaled = [r for r in rows if r["floor_scaled"] and r["status"] == "ok"]
    if scaled:
        out.append("")
    for r in scaled:
        (n0, n), full = r["floor_scaled"]["layers"], r["floor_scaled"]["full_layers"]
        out.append(
            f"- {r['regime']} / {r['arm']} at {r['world_size']} GPUs: floor scaled from {n} "
            f"layers to {full} (a line through {n0} and {n}); its peak GiB is the {n}-layer model's"
        )
    return "\n".join(out) + "\n"


def _f(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def chart(rows: list[dict], path: Path) -> bool:
    """Tokens/s/GPU and efficiency against the world size, per regime; False if skipped."""
    plt = pyplot()
    if plt is None:
        return False
    regimes = list(dict.fromkeys(r["regime"] for r in rows))
    sizes = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(len(regimes), 2, figsize=(12, 4 * len(regimes)), squeeze=False)
    for row, regime in enumerate(regimes):
        mine = [r for r in rows if r["regime"] == regime and r["status"] == "ok"]
        for col, (key, title) in enumerate(
            (("tokens_per_s_per_gpu", "tokens/s/GPU"), ("efficiency", "weak-scaling efficiency"))
        ):
            ax = axes[row][col]
            for arm in dict.fromkeys(r["arm"] for r in mine):
                points = [(r["world_size"], r[key]) for r in mine
                          if r["arm"] == arm and r[key] is not None]  # fmt: skip
                if points:
                    label = next(r["label"] for r in mine if r["arm"] == arm)
                    ax.plot(*zip(*points), marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(n) for n in sizes])
            ax.set_xlabel("GPUs")
            ax.set_title(f"regime {regime}: {title}", fontsize=10)
            ax.set_ylim(bottom=0)
            if key == "efficiency":
                ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
            else:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(folders: list[Path], out: Path, *, peak_tflops: float | None = None) -> str:
    """Read the folders, write ``scaling.md``, ``scaling.json`` and the chart into ``out``."""
    records = load(folders)
    rows = rows_of(records, peak_tflops=peak_tflops)
    text = markdown(rows, records)
    out.mkdir(parents=True, exist_ok=True)
    (out / TABLE).write_text(text)
    (out / ROWS).write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    chart(rows, out / CHART)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="bench.run outputs, one per world size")
    p.add_argument("--out", required=True, type=Path, help="folder for scaling.md/.json/.png")
    p.add_argument("--peak-tflops", type=float,
                   help="dense bf16 peak per GPU for MFU (default: from the GPU's name)")  # fmt: skip
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(write(args.folders, args.out, peak_tflops=args.peak_tflops))


if __name__ == "__main__":
    main()
