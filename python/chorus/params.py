# chorus.params - prints the core's parameter table (`python -m chorus.params`), or as the
# Markdown table of the README (`--markdown`). The table itself lives in the C core.
import argparse
import sys
import types

from ._C import params as _params


def _cell(text):
    # Markdown table cells: pipes would split the cell, newlines would end the row.
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(rows):
    lines = [
        "| Name | NCCL fallback | Type | Default | Description |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        nccl = f"`{r['nccl_env']}`" if r["nccl_fallback"] else "-"
        default = f"`{r['default']}`" if r["default"] != "" else "(empty)"
        lines.append(
            f"| `{r['env']}` | {nccl} | {r['type']} | {_cell(default)} | {_cell(r['doc'])} |"
        )
    return "\n".join(lines)


def plain(rows):
    out = []
    for r in rows:
        nccl = f" (or {r['nccl_env']})" if r["nccl_fallback"] else ""
        out.append(f"{r['env']}{nccl}  [{r['type']}, default {r['default']!r}]")
        out.append(f"    value {r['value']!r} from {r['source'] or 'default'}")
        out.append(f"    {r['doc']}")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m chorus.params", description=__doc__)
    ap.add_argument("--markdown", action="store_true", help="print the README's Markdown table")
    args = ap.parse_args(argv)
    rows = _params()
    print(markdown(rows) if args.markdown else plain(rows))
    return 0


class _CallableModule(types.ModuleType):
    # `import chorus.params` rebinds the package attribute chorus.params from the function to
    # this module; keep chorus.params() working either way.
    def __call__(self):
        return _params()


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
