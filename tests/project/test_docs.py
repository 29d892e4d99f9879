"""The docs site's sources stay true: the generated reference pages, the README's commands on the index
page, the runbooks page against the rules, and the runbook URLs' one base (the built site, in a browser:
tests/project/test_docs_site.py)."""

from __future__ import annotations

import argparse
import importlib.util
import io
import re
from pathlib import Path

import pytest
import yaml

from openlora_otel.commands import rules as rules_command
from openlora_otel.stack import DEFAULT_RUNBOOK_BASE, rules_text

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def generator():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_reference_pages_are_current() -> None:
    pages = generator().pages()
    assert {path.name for path in pages} == {
        "configuration.md", "metrics.md", "cli.md", "api.md", "gpu-metrics.md", "host-metrics.md",
    }
    stale = [str(path.relative_to(ROOT)) for path, text in pages.items() if not path.is_file() or path.read_text() != text]
    assert not stale, f"stale docs pages {stale}: run `python docs/generate.py`"


def test_cli_page_has_every_command_help() -> None:
    from openlora_otel.commands import COMMANDS

    page = (DOCS / "reference" / "cli.md").read_text()
    for command in COMMANDS:
        name = command.__name__.rsplit(".", 1)[1]
        assert f"## `openlora-otel {name}`\n\n```text\nusage: openlora-otel {name} " in page, name
    assert "--runbook-base URL" in page


def test_every_page_in_the_nav_exists_and_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))
    assert config["strict"] is True and config["theme"]["font"] is False

    def leaves(items: list) -> list[str]:
        out = []
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            out += leaves(value) if isinstance(value, list) else [value]
        return out

    nav = leaves(config["nav"])
    assert sorted(nav) == sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


def _block(text: str, marker: str) -> str:
    match = re.search(rf"<!-- {marker}:start -->\n```bash\n(.*?)\n```\n<!-- {marker}:end -->", text, re.S)
    assert match, f"no {marker} block"
    return match.group(1)


def test_index_page_carries_the_readme_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    index = (DOCS / "index.md").read_text()
    for marker in ("run-command", "test-command"):
        assert _block(index, marker) == _block(readme, marker), f"docs/index.md's {marker} differs from the README's"


def alerts() -> list[str]:
    groups = yaml.safe_load(rules_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_every_alert_has_a_runbook_section_at_its_url_anchor() -> None:
    page = (DOCS / "runbooks.md").read_text()
    sections = dict(re.findall(r"^### (\w+) \{#([a-z0-9]+)\}$", page, re.M))
    assert set(sections) == set(alerts())
    for group in yaml.safe_load(rules_text())["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                url = rule["annotations"]["runbook_url"]
                assert url == f"{DEFAULT_RUNBOOK_BASE}#{sections[rule['alert']]}", rule["alert"]
    # The README's section now points at the page.
    readme = (ROOT / "README.md").read_text()
    assert "[Alert runbooks](docs/runbooks.md)" in readme
    assert not re.search(r"^### Openlora\w+$", readme, re.M)


def run_rules(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    parser = argparse.ArgumentParser(prog="openlora-otel")
    rules_command.register(parser.add_subparsers(dest="command"))
    code = rules_command.run(parser.parse_args(["rules", *argv]), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_rules_command_replaces_the_runbook_base_and_nothing_else(tmp_path: Path) -> None:
    code, out, _ = run_rules()
    assert code == 0 and out == rules_text()
    base = "http://127.0.0.1:8000/runbooks/"
    code, out, _ = run_rules("--runbook-base", base)
    assert code == 0
    urls = re.findall(r'runbook_url: "([^"]+)"', out)
    assert len(urls) == len(alerts()) and all(url.startswith(base + "#") for url in urls)
    assert DEFAULT_RUNBOOK_BASE + "#" not in out
    # Only the URLs changed: the same rules otherwise.
    changed = yaml.safe_load(out)
    for group in changed["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["annotations"]["runbook_url"] = rule["annotations"]["runbook_url"].replace(base, DEFAULT_RUNBOOK_BASE)
    assert changed == yaml.safe_load(rules_text())
    target = tmp_path / "openlora.yml"
    code, _, err = run_rules("--runbook-base", base, "--output", str(target))
    assert code == 0 and target.read_text() == out and str(target) in err
    code, _, err = run_rules("--output", str(tmp_path / "missing" / "openlora.yml"))
    assert code == 2 and "cannot write" in err
    for bad in ("", "http://x/a b", 'http://x/"', "http://x/#y"):
        with pytest.raises(SystemExit) as exited:
            run_rules("--runbook-base", bad)
        assert exited.value.code == 2


def test_the_testing_page_names_every_property_based_test_file() -> None:
    """Each test file that takes the shared settings of tests/support/fuzz.py is in the testing page's
    table, and the page says the default number of examples that file has."""
    from tests.support import docs_text

    table = docs_text.marked("docs/testing.md", "fuzz-tests")
    files = [
        path.relative_to(ROOT).as_posix()
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if re.search(r"^from tests\.support\.fuzz import fuzz$", path.read_text(), re.M)
    ]
    assert files
    assert [name for name in files if f"| `{name}` |" not in table] == []
    default = re.search(r'"OPENLORA_FUZZ_EXAMPLES", "(\d+)"', (ROOT / "tests/support/fuzz.py").read_text())
    assert default and f"(default {default[1]})" in docs_text.text("docs/testing.md")
