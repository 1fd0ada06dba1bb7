"""The TPU numbers: `benchmarks/tpu.sh`'s output folder to
`benchmarks/results/tpu-v5e.json`, and that file to the table in
`docs/guides/speed.md` (between its ``tpu-table`` markers).

Run: ``python scripts/tpu_results.py [DIR]``: with DIR (the files of a
`benchmarks/tpu.sh` run: ``cells.json``, ``lm.json``, ``steps.json``,
``nan.json``, ``commit.txt``), the JSON file is written from them first;
the table is always written from the JSON file.
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


def collect(folder: pathlib.Path) -> dict[str, Any]:
    """One record of a `benchmarks/tpu.sh` run's files."""
    record: dict[str, Any] = {"commit": (folder / "commit.txt").read_text().strip()}
    for part in PARTS:
        data = json.loads((folder / f"{part}.json").read_text())
        record["device"], record["jax"] = data.pop("device"), data.pop("jax")
        record[part] = data
    return record


def table(record: dict[str, Any]) -> str:
    """The guide's Markdown for `record`."""
    cells, lm, steps, nan = (record[part] for part in PARTS)
    rows = [
        f"Measured on one {record['device']} (JAX {record['jax']}) by "
        f"`bash benchmarks/tpu.sh` at commit `{record['commit'][:10]}`; "
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
    return "\n".join(rows)


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
        record = collect(pathlib.Path(sys.argv[1]))
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    write_table(json.loads(RESULTS.read_text()))


if __name__ == "__main__":
    main()
