"""Every lesson, lab and solution opens the same way, so that it runs on a cloud notebook as on a laptop.

Its first code cell is the set-up cell (shardlib.course.export.SETUP_CELL: installs the course when
`import shardlib` fails), its second the one cell tagged `parameters`, which sets DEVICE ("auto", "cpu"
or "cuda") before anything uses it; and DEVICE is read after it (a DEVICE that no cell reads, beside
launches that hard-code their device, would promise a choice that does not exist). A lesson that only
simulates ranks (lesson 14) sets DEVICE = "meta": its tensors have shapes and no data, and it starts no
rank, so no cell may call `launch`.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from shardlib.course.export import SETUP_CELL
from shardlib.devices import DEVICES

REPO_ROOT = Path(__file__).resolve().parent.parent
SIMULATED = "meta"  # the device of a lesson whose ranks are simulated (shardlib.simulate): nothing is allocated
NOTEBOOKS = [p for folder in ("notebooks", "labs", "solutions") for p in sorted((REPO_ROOT / folder).glob("*.ipynb"))]


def _source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _python(source: str) -> str:
    """A cell's code without IPython's magics and shell escapes (`%pip`, `!ls`), which ast cannot read."""
    return "\n".join("pass" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def opening_problems(notebook: dict) -> list[str]:
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    tagged = [i for i, cell in enumerate(code) if "parameters" in cell.get("metadata", {}).get("tags", [])]
    problems = []
    if not code or _source(code[0]).strip() != SETUP_CELL:
        problems.append("the first code cell is not the set-up cell (shardlib.course.export.SETUP_CELL)")
    if tagged != [1]:
        problems.append(f"code cells tagged `parameters`: {tagged}; exactly one, the second code cell")
        return problems
    device = [node.value for node in ast.walk(ast.parse(_python(_source(code[1]))))
              if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DEVICE" for t in node.targets)]
    if not device or not isinstance(device[0], ast.Constant) or device[0].value not in (*DEVICES, SIMULATED):
        problems.append(f"the parameters cell does not set DEVICE to one of {', '.join(DEVICES)} "
                        f"(or {SIMULATED!r} in a lesson that starts no rank)")
    elif device[0].value == SIMULATED and any("launch(" in _source(cell) for cell in code[2:]):
        problems.append(f"DEVICE is {SIMULATED!r} (simulated ranks) but a cell calls launch: set a real device")
    elif not any(isinstance(node, ast.Name) and node.id == "DEVICE" and isinstance(node.ctx, ast.Load)
                 for cell in code[2:] for node in ast.walk(ast.parse(_python(_source(cell))))):
        problems.append("no cell after the parameters cell reads DEVICE")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_notebook_opens_with_the_set_up_cell_and_its_parameters(path):
    problems = opening_problems(json.loads(path.read_text(encoding="utf-8")))
    assert not problems, f"{path.parent.name}/{path.name}: " + "; ".join(problems)


def notebook(*cells):
    return {"cells": [{"cell_type": "code", "source": source, "metadata": {"tags": list(tags)}}
                      for source, tags in cells]}


GOOD = (SETUP_CELL, ()), ('DEVICE = "auto"\nWORLD_SIZES = (2, 4)', ("parameters",)), \
    ("shardlib.launch(fn, 2, device=DEVICE)", ())


@pytest.mark.parametrize("cells, words", [
    (GOOD[1:], "not the set-up cell"),
    (((SETUP_CELL, ()), ('DEVICE = "auto"', ()), GOOD[2]), "tagged `parameters`: []"),
    ((GOOD[0], ("WORLD_SIZES = (2,)", ("parameters",)), GOOD[2]), "does not set DEVICE"),
    ((GOOD[0], ('DEVICE = "gpu"', ("parameters",)), GOOD[2]), "does not set DEVICE"),
    ((GOOD[0], GOOD[1], ('shardlib.launch(fn, 2, device="cpu")', ())), "no cell after the parameters cell reads DEVICE"),
    ((GOOD[0], ('DEVICE = "meta"', ("parameters",)), GOOD[2]), "but a cell calls launch"),
])
def test_a_notebook_without_them_is_caught(cells, words):
    problems = opening_problems(notebook(*cells))
    assert any(words in problem for problem in problems), problems


def test_a_notebook_with_them_passes():
    assert opening_problems(notebook(*GOOD)) == []
    simulated = GOOD[0], ('DEVICE = "meta"', ("parameters",)), ("torch.empty(8, device=DEVICE)", ())
    assert opening_problems(notebook(*simulated)) == []
