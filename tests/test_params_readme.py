"""The README's parameter table is the one the library prints, and says what core.h declares.
(Regenerate it with `make readme-params`.)"""
import re

from readme_params import chorus_params_markdown, core_params, readme_table


def _rows(table):
    rows = []
    for line in table.splitlines():
        line = line.strip()
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows.append(cells)
    return rows[1:]  # without the header


def test_readme_parameter_table_equals_chorus_params_markdown():
    got = [line.rstrip() for line in readme_table().strip().splitlines()]
    want = [line.rstrip() for line in chorus_params_markdown().strip().splitlines()]
    assert got == want


def test_readme_parameter_table_lists_every_core_parameter():
    def plain(cell):
        cell = cell.strip("`").replace("\\|", "|")
        return "" if cell in ("(empty)", '""', "—", "-", "") else cell

    readme = {plain(r[0]): [plain(c) for c in r[1:]] for r in _rows(readme_table())}
    core = core_params()
    assert core, "no entry parsed from CHORUS_PARAM_TABLE"
    assert sorted(readme) == sorted(f"CHORUS_{name}" for name, *_ in core)
    for name, typ, default, nccl, doc in core:
        fallback, rtyp, rdefault, rdoc = readme[f"CHORUS_{name}"]
        assert fallback == (f"NCCL_{name}" if nccl else ""), name
        assert (rtyp, rdefault, rdoc) == (typ, default, doc), name
