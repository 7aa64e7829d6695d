"""The docs say what the code does: docs/configuration.md lists exactly the ECCL_*
variables of eccl's one list (`eccl::variables::VARIABLES`, exported as
`eccl._eccl.VARIABLES`) with their defaults, no source file reads a variable that is not
in it, and the page lists exactly the flags each binary's --help shows. No page names an
issue number."""

import re
import shlex
import subprocess
from pathlib import Path

import eccl

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "docs" / "configuration.md"
BINARIES = ["eccl-master", "eccl-bench", "eccl-chaos"]
# Subcommands whose flags have a table of their own.
SUBCOMMANDS = [["eccl-chaos", "load"]]


def _table(section: str):
    """The rows of the first table after the heading `section` of the page."""
    text = CONFIG.read_text()
    start = text.index(section)
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#") and rows:
            break
        if line.startswith("| ") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[1:]      # past the header


def test_the_page_lists_every_variable_with_its_default():
    listed = {r[0].strip("`"): r[1] for r in _table("## Environment variables")}
    known = {name: default for name, default, _, _ in eccl._eccl.VARIABLES}
    assert set(listed) == set(known), set(listed) ^ set(known)
    for name, default in known.items():
        assert listed[name].strip("`") == default, (name, listed[name], default)


def test_no_source_reads_a_variable_missing_from_the_list():
    known = {v[0] for v in eccl._eccl.VARIABLES}
    used = set()
    for pattern in ("*.rs", "*.py", "*.sh"):
        for f in ROOT.rglob(pattern):
            if any(part in (".venv", "target", ".venv-torchft", ".git") for part in f.parts):
                continue
            used |= set(re.findall(r"\bECCL_[A-Z][A-Z0-9_]*", f.read_text(errors="replace")))
    missing = used - known
    assert not missing, f"read but not in eccl::variables::VARIABLES: {sorted(missing)}"


def _flags_of(binary: str, *sub: str):
    """The long flags `binary [sub...] --help` lists."""
    out = subprocess.run([str(ROOT / "target" / "release" / binary), *sub, "--help"],
                         capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z0-9_-]*)", out, re.M)) - {"--help", "--version"}


def test_the_page_lists_every_flag_of_every_binary():
    for binary, *sub in [[b] for b in BINARIES] + SUBCOMMANDS:
        heading = " ".join([binary, *sub])
        listed = {re.search(r"--[a-z][a-z0-9_-]*", r[0]).group(0)
                  for r in _table(f"### `{heading}`")}
        shown = _flags_of(binary, *sub)
        assert listed == shown, (heading, listed ^ shown)


def test_no_page_names_an_issue_number():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        hits = re.findall(r"\bissues? \d+|\bissue-\d+", page.read_text(), re.I)
        assert not hits, (page.name, hits)


def test_links_between_pages_resolve():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            assert (page.parent / target).exists(), (page.name, target)


def test_the_readme_torch_example_runs_as_written(tmp_path):
    """The README's first PyTorch job, run the way it says: torchrun, two processes."""
    import sys

    import procs
    from procs import free_port
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(# train\.py.*?)```", text, re.S)
    assert block, "the README's train.py block"
    script = tmp_path / "train.py"
    script.write_text(block.group(1))
    # Each rank's output to a file of its own (torchrun's --redirects): two ranks printing
    # at once can interleave on one pipe.
    logs = tmp_path / "logs"
    out = procs.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     f"--master-port={free_port()}", "--log-dir", str(logs),
                     "--redirects", "3", str(script)],
                    capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    printed = [line for f in logs.rglob("stdout.log") for line in f.read_text().splitlines()]
    assert sorted(line for line in printed if line.endswith(" done")) == \
        ["0 done", "1 done"], printed


BINARY = re.compile(r"(?:^|/)(eccl-bench|eccl-chaos|eccl-master)$")
EXAMPLE = re.compile(r"(?:^|/)examples/(\w+\.py)$")


def _doc_commands():
    """Every shell command of the README and the docs: (page, words), continuation lines
    joined, comments and `VAR=value` prefixes dropped, `a && b` split."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```(?:sh|bash)\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip()
                if not line or line.startswith("#"):
                    continue
                for part in line.split("&&"):
                    words = shlex.split(part)
                    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                        words.pop(0)
                    if words:
                        yield page.name, words


def _program(words):
    """(what runs, its arguments) for eccl's binaries and examples; None otherwise.
    `cargo run ... -p eccl-chaos -- ARGS` runs eccl-chaos."""
    if words[:2] == ["cargo", "run"] and "--" in words:
        package = words[words.index("-p") + 1] if "-p" in words else None
        return (package, words[words.index("--") + 1:]) if package else None
    for i, w in enumerate(words[:3]):
        if BINARY.search(w) or EXAMPLE.search(w):
            return w.rsplit("/", 1)[-1], words[i + 1:]
    return None


def _long_flags(args):
    return {a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2}


def test_every_documented_command_uses_flags_its_program_has():
    """A command in the README or the docs names only flags its program takes: the
    binaries' --help (of the subcommand, for `eccl-master cluster status`), the examples'
    argparse definitions. Catches a page left behind when a flag is renamed."""
    checked = 0
    for page, words in _doc_commands():
        found = _program(words)
        if found is None:
            continue
        program, args = found
        used = _long_flags(args)
        if program.endswith(".py"):
            source = (ROOT / "examples" / program).read_text()
            known = set(re.findall(r"add_argument\(\s*(?:\"-\w\",\s*)?\"(--[a-z0-9-]+)\"", source))
        else:
            sub = []
            # `eccl-master cluster status ...`, `eccl-chaos load ...`: the words before a flag
            if program in ("eccl-master", "eccl-chaos"):
                for a in args:
                    if a.startswith("-"):
                        break
                    sub.append(a)
            if program == "eccl-bench" and args[:1] in (["probe"], ["plot"]):
                continue   # their arguments are short flags and files
            known = _flags_of(program, *sub)
        assert used <= known, f"{page}: `{' '.join(words)}` uses {sorted(used - known)}"
        checked += 1
    assert checked >= 15, checked
