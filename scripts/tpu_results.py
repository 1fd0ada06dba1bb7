"""The TPU numbers: `benchmarks/tpu.sh`'s output folders to
`benchmarks/results/tpu-v5e.json`, and that file to the table in
`docs/guides/speed.md` (between its ``tpu-table`` markers).

Run: ``python scripts/tpu_results.py [DIR ...]``: with DIRs (the files of
`benchmarks/tpu.sh` runs: ``cells.json``, ``lm.json``, ``steps.json``,
``nan.json``, and issue 56's ``attention.json``, ``long.json`` and
``long_xla.json``, each with its ``commit.txt``), each part found there
replaces the JSON file's (a later DIR's over an earlier one's; the parts
found nowhere are kept, each with the commit it was measured at); the table
is always written from the JSON file.
"""

import json
import pathlib
import sys
from typing import Any


ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "tpu-v5e.json"
GUIDE = ROOT / "docs" / "guides" / "speed.md"
START, END = "<!-- tpu-table start -->", "<!-- tpu-table end -->"
PARTS = ("cells", "lm", "steps", "nan")
# Issue 56's parts: attention alone, the long-sequence decoder, and its loss
# against XLA's attention. The table shows those present.
LONG_PARTS = ("attention", "long", "long_xla")


def collect(folders: list[pathlib.Path], previous: dict[str, Any]) -> dict[str, Any]:
    """One record of `benchmarks/tpu.sh` runs' files, over `previous` (the
    JSON file's record, or empty)."""
    record = dict(previous)
    # Each part's commit (a record from before issue 56 has one for all).
    commits = record.pop("commits", None) or {
        part: record["commit"] for part in (*PARTS, *LONG_PARTS) if part in record
    }
    for folder in folders:
        commit = (folder / "commit.txt").read_text().strip()
        for part in (*PARTS, *LONG_PARTS):
            path = folder / f"{part}.json"
            if not path.exists():
                continue
            data = json.loads(path.read_text())
            if part in PARTS:  # issue 56's parts keep their own
                record["device"], record["jax"] = data.pop("device"), data.pop("jax")
            record[part], commits[part] = data, commit
        record["commit"] = commit
    missing = [part for part in PARTS if part not in record]
    if missing:
        raise SystemExit(f"no {', '.join(missing)} in {', '.join(map(str, folders))}")
    return record | {"commits": commits}


def table(record: dict[str, Any]) -> str:
    """The guide's Markdown for `record`."""
    cells, lm, steps, nan = (record[part] for part in PARTS)
    commit = _commit(record, "cells")
    rows = [
        f"Measured on one {record['device']} (JAX {record['jax']}) by "
        f"`bash benchmarks/tpu.sh` at commit `{commit}`; "
        "`benchmarks/results/tpu-v5e.json` holds every round. Speed ÷ a "
        "hand-written `jax.jit` loop of the same model (`benchmarks/"
        "references.py`), batches on the device, the median of "
        f"{len(cells['wide']['hand']['rounds_s'])} alternating rounds. The "
        'default (`nan_policy="raise"`) is the held guard for a gradient of 16 '
        "MiB or more, else the gated one: in bold.",
        "",
        "| MLP, batch | hand loop ms/step | held guard | gated guard "
        '| `steps_per_call=8` | `nan_policy="off"` |',
        "|---|---|---|---|---|---|",
    ]
    for cell in cells.values():
        off = cell.get('nan_policy="off" ratio')
        guards = [cell["default ratio"], cell.get("gated guard ratio")]
        default = 0 if _gradient_bytes(cell["model"]) >= 16 * 2**20 else 1
        shown = [
            "-" if r is None else f"**{r:.3f}**" if i == default else f"{r:.3f}"
            for i, r in enumerate(guards)
        ]
        rows.append(
            f"| {cell['model'][4:]}, {cell['batch']} | {cell['hand']['ms']:.3f} | "
            f"{shown[0]} | {shown[1]} | {cell['steps_per_call=8 ratio']:.3f} | "
            f"{'-' if off is None else f'{off:.3f}'} |"
        )
    rows += [
        "",
        "| model (bf16, adamw) | hand loop ms/step | MFU | phalanx ms/step | MFU "
        "| phalanx ÷ hand |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "gpt2": "GPT-2 small decoder (`examples/language_model.py`), 8 × 1,024",
        "tests_transformer": "tests' `Stacked` transformer, 32 × 512",
    }
    for name, cell in lm.items():
        if name not in names:
            continue
        hand, fit = cell["hand"], cell["phalanx"]
        rows.append(
            f"| {names[name]} | {hand['ms']:.1f} | {hand['mfu']:.1%} | "
            f"{fit['ms']:.1f} | {fit['mfu']:.1%} | {cell['phalanx ratio']:.3f} |"
        )
    one, many = steps["1"], steps["32"]
    skip = cells["wide"].get('nan_policy="skip" ratio')
    rows += [
        "",
        *(
            []
            if skip is None
            else [f'`nan_policy="skip"` on the widest MLP: {skip:.3f}.', ""]
        ),
        f"`steps_per_call=32` on the 16-16-4 MLP: {many['steps_per_s']:,.0f} steps "
        f"a second, {many['speedup']:.2f}× `steps_per_call=1`'s "
        f"{one['steps_per_s']:,.0f}; the compiled call's temporaries "
        f"{many['temporary_bytes']:,} bytes against {one['temporary_bytes']:,}. "
        f"A NaN gradient planted at step 3: `raise` stopped "
        f"{'naming step 3' if nan['raise_names_step_3'] else 'WITHOUT naming step 3'}"
        f" with {'the' if nan['raise_state_equals_3_clean_steps'] else 'NOT the'} "
        f"state of 3 clean steps; `skip` counted {nan['skip_skipped_steps']:.0f} "
        "skipped step.",
    ]
    if "attention" in record:
        rows += ["", *_attention(record["attention"], _commit(record, "attention"))]
    if "long" in record or "long_xla" in record:
        rows += ["", *_long(record, _commit(record, "long"))]
    return "\n".join(rows)


def _commit(record: dict[str, Any], part: str) -> str:
    """The commit `part` was measured at, short."""
    return record.get("commits", {}).get(part, record["commit"])[:10]


def _attention(cells: list[dict[str, Any]], commit: str) -> list[str]:
    """Issue 56's attention table: the kernel against XLA's attention."""
    first = cells[0]
    rows = [
        f"Attention alone (`benchmarks/attention.py` at commit `{commit}`, "
        f"{first.get('device', 'the chip')}): `px.models.dot_product_attention` "
        f"against XLA's attention, causal forward and backward, batch "
        f"{first['batch']}, {first['heads']} heads of {first['dim']}. FLOP/s count "
        "the unmasked half of the scores, a forward and backward pass as 3 "
        "forwards (the model's FLOPs; in brackets 3.5, the FlashAttention "
        "papers' count with the backward's recomputed scores); the fraction is "
        "of the chip's peak for the dtype (phalanx's table).",
        "",
        "| tokens, dtype | phalanx ms | TFLOP/s | of peak | XLA ms | TFLOP/s "
        "| of peak | planned memory, phalanx / XLA |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        sides = [_attention_side(cell, side) for side in ("phalanx", "xla")]
        memory = " / ".join(
            "-" if cell[f"{side}_planned_bytes"] is None
            else f"{cell[f'{side}_planned_bytes'] / 2**30:.2f} GiB"
            for side in ("phalanx", "xla")
        )  # fmt: skip
        rows.append(
            f"| {cell['seq']:,}, {cell['dtype']} | {sides[0]} | {sides[1]} | {memory} |"
        )
    return rows


def _attention_side(cell: dict[str, Any], side: str) -> str:
    """One side's three columns: ms, TFLOP/s and the fraction of the peak."""
    if cell[f"{side}_error"]:
        return f"{cell[f'{side}_error']} | - | -"

    def both(key: str, form: str) -> str:
        model, flash = (cell[f"{side}_{key}_{n}"] for n in ("model", "flashattention"))
        return "-" if model is None else f"{model:{form}} ({flash:{form}})"

    return (
        f"{cell[f'{side}_s'] * 1e3:.2f} | {both('tflops', '.1f')} | "
        f"{both('peak_fraction', '.1%')}"
    )


def _long(record: dict[str, Any], commit: str) -> list[str]:
    """Issue 56's decoder at long sequences, and its loss against XLA's."""
    rows = []
    if "long" in record:
        long = record["long"]
        runs = long["runs"]
        model = long["model"]
        parameters = next((r["parameters"] for r in runs if "parameters" in r), 0)
        rows += [
            f"A decoder of {parameters / 1e6:.1f} M parameters "
            f"(`examples/long_sequence.py` at commit `{commit}`, {long['device']}: "
            f"{model['layers']} `TransformerBlock`s of width {model['width']}, "
            f"{model['heads']} heads, `Stacked(remat=True)`, {long['precision']}) "
            "trained at batch 1 on the one chip: the median step after the first "
            "(which compiles); the peak is the device's `peak_bytes_in_use`, the "
            "process' high-water mark, the sequences run in increasing order.",
            "",
            "| tokens | ms/step | tokens/s | peak memory | loss, first → last step |",
            "|---|---|---|---|---|",
        ]
        for run in runs:
            if "error" in run:
                rows.append(f"| {run['seq']:,} | {run['error']} | - | - | - |")
                continue
            peak = run["peak_bytes_in_use"]
            rows.append(
                f"| {run['seq']:,} | {_number(run['ms_per_step'], ',.1f')} | "
                f"{_number(run['tokens_per_s'], ',.0f')} | "
                f"{'-' if peak is None else f'{peak / 2**30:.2f} GiB'} | "
                f"{run['losses'][0]:.4f} → {run['loss']:.4f} |"
            )
    if "long_xla" in record:
        compared = record["long_xla"]["compare_xla"]
        rows += [
            *([""] if rows else []),
            f"The same model from the same key on the same batches at "
            f"{compared['seq']:,} tokens ({record['long_xla']['precision']}), "
            f"{compared['steps']} steps: loss {compared['loss_auto']:.6f} with "
            f'`implementation="auto"` (on a TPU the splash kernel), '
            f'{compared["loss_xla"]:.6f} with XLA\'s attention (`"xla"`): '
            "|difference| "
            f"{compared['abs_difference']:.1e}.",
        ]
    return rows


def _number(value: float | None, form: str) -> str:
    return "-" if value is None else f"{value:{form}}"


def _gradient_bytes(model: str) -> int:
    """The float32 gradient's bytes of an MLP described as ``"MLP a-b-c"``."""
    sizes = [int(n) for n in model.split()[-1].split("-")]
    return 4 * sum(a * b + b for a, b in zip(sizes, sizes[1:], strict=False))


def write_table(record: dict[str, Any]) -> None:
    """Put `table(record)` between the guide's markers."""
    text = GUIDE.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    GUIDE.write_text(f"{head}{START}\n{table(record)}\n{END}{tail}")


def main() -> None:
    if len(sys.argv) > 1:
        previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        record = collect([pathlib.Path(arg) for arg in sys.argv[1:]], previous)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    write_table(json.loads(RESULTS.read_text()))


if __name__ == "__main__":
    main()
