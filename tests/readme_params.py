"""The README's parameter table: reading it, parsing CHORUS_PARAM_TABLE from core.h, and
regenerating the table.

  python tests/readme_params.py --update      rewrite the README table from
                                              `python -m chorus.params --markdown`
  python tests/readme_params.py --from-core   print a table made from core.h (no build needed)
"""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
CORE_H = os.path.join(REPO, "csrc", "core", "core.h")
BEGIN, END = "<!-- params:begin -->", "<!-- params:end -->"
HEADER = "| Variable | NCCL fallback | Type | Default | Description |"


def readme_table(text=None):
    text = open(README).read() if text is None else text
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n")


def core_params():
    """[(name, type, default, nccl_fallback, doc)] from CHORUS_PARAM_TABLE in core.h."""
    src = open(CORE_H).read()
    start = src.index("#define CHORUS_PARAM_TABLE(X)")
    end = src.index("enum param_id", start)
    body = src[start:end].replace("\\\n", " ")
    entry = re.compile(r'X\(\s*\w+\s*,\s*"([^"]*)"\s*,\s*"([^"]*)"\s*,\s*"([^"]*)"\s*,\s*([01])\s*,'
                       r'\s*((?:"(?:[^"\\]|\\.)*"\s*)+)\)')
    out = []
    for m in entry.finditer(body):
        doc = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(5)))
        out.append((m.group(1), m.group(2), m.group(3), m.group(4) == "1", doc))
    return out


def markdown_from_core():
    lines = [HEADER, "|---|---|---|---|---|"]
    for name, typ, default, nccl, doc in core_params():
        fallback = f"`NCCL_{name}`" if nccl else "—"
        shown = f"`{default}`" if default else "(empty)"
        doc = doc.replace("|", "\\|")
        lines.append(f"| `CHORUS_{name}` | {fallback} | {typ} | {shown} | {doc} |")
    return "\n".join(lines)


def chorus_params_markdown():
    proc = subprocess.run([sys.executable, "-m", "chorus.params", "--markdown"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m chorus.params --markdown exited {proc.returncode}:\n"
                           f"{proc.stdout}{proc.stderr}")
    return proc.stdout.strip("\n")


def write_table(table):
    text = open(README).read()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    open(README, "w").write(text[:start] + "\n" + table + "\n" + text[end:])


if __name__ == "__main__":
    if "--update" in sys.argv:
        write_table(chorus_params_markdown())
    elif "--from-core" in sys.argv:
        print(markdown_from_core())
    else:
        sys.exit(__doc__)
