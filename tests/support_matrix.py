"""Generate the model support matrix of docs/configuration.md from the family tests' results.

    python -m tests.support_matrix            # run the family tests, rewrite the table in docs/configuration.md
    python -m tests.support_matrix --junit F  # build the table from an existing junit XML file instead

Each cell is the outcome of one test (tests/engine/test_families.py, tests/integration/test_families_http.py):
"exact" = equals transformers' generate token for token; "refused" = refused at load with the feature named;
"FAILED" = the test failed; "-" = not applicable or not tested. Nothing in the table is written by hand.
A full test run compares the table its results make with the committed one (tests/conftest.py).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "docs" / "configuration.md"
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"
TESTS = ["tests/engine/test_families.py", "tests/integration/test_families_http.py"]


def run_tests(junit: Path) -> None:
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *TESTS],
                   cwd=REPO, check=False)


def outcomes(junit: Path) -> dict[str, str]:
    """Test name (function[param]) -> passed | failed | skipped; a recorded property ``p`` of a test is
    added as ``name#p``."""
    result: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        state = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                state = "failed"
            elif child.tag == "skipped":
                state = "skipped"
            elif child.tag == "properties":
                for prop in child:
                    result[f"{case.attrib['name']}#{prop.attrib['name']}"] = prop.attrib["value"]
        result[case.attrib["name"]] = state
    return result


def _cell(results: dict[str, str], test: str, ok: str = "exact") -> str:
    state = results.get(test)
    return "-" if state is None else ok if state == "passed" else state.upper()


def build_table(results: dict[str, str]) -> str:
    from handlers.synthetic_model import FAMILIES, SIZES

    def http_cell(family: str) -> str:
        for name, state in results.items():
            if name.startswith("test_families_through_http_equal_generate[") and \
                    family in name[name.index("[") + 1:-1].split("+"):
                return "exact" if state == "passed" else state.upper()
        return "-"

    def bf16_cell(family: str) -> str:
        # "close": the next-token choices agree at >= 90% of positions; where greedy paths part (if they do)
        # depends on the CPU's bf16 kernels, so the test reports it and the table does not
        return _cell(results, f"test_bf16_against_generate_bf16[{family}]", "close")

    rows = ["| family (layout) | model_type | rolling engine | through HTTP | dynamic batching | tensor parallel (2) "
            "| sliding window | prefix caching | bf16 vs generate bf16 |", "|---|---|---|---|---|---|---|---|---|"]
    for family in sorted(FAMILIES):
        model_type, kwargs = FAMILIES[family](SIZES["tiny"], 64)
        exact = results.get(f"test_family_equals_generate[{family}]")
        refused = results.get(f"test_family_refused_by_name[{family}]")
        engine = _cell(results, f"test_family_equals_generate[{family}]") if exact else \
            _cell(results, f"test_family_refused_by_name[{family}]", "refused") if refused else "-"
        if engine == "refused":
            http = "refused" if results.get("test_refused_families_fail_with_the_reason") == "passed" else "-"
        else:
            http = http_cell(family)
        tp = _cell(results, f"test_tensor_parallel_equals_generate[{family}]")
        if tp == "-" and f"test_tensor_parallel_refused_before_ranks_start[{family}]" in results:
            tp = _cell(results, f"test_tensor_parallel_refused_before_ranks_start[{family}]", "refused")
        windowed = bool(kwargs.get("sliding_window")) and kwargs.get("use_sliding_window", True)
        window = (engine if engine in ("exact", "refused") else "-") if windowed else "-"
        rows.append(f"| {family} | {model_type} | {engine} | {http} | "
                    f"{_cell(results, f'test_dynamic_batching_equals_generate[{family}]')} | {tp} | {window} | "
                    f"{engine if engine == 'exact' else '-'} | {bf16_cell(family)} |")
    return "\n".join(rows)


def committed_table() -> str:
    """The table as docs/configuration.md has it."""
    text = README.read_text(encoding="utf-8")
    return text[text.index(START) + len(START):text.index(END)].strip("\n")


def rewrite_readme(table: str) -> None:
    text = README.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{README} has no {START} ... {END} section")
    README.write_text(pattern.sub(lambda _: f"{START}\n{table}\n{END}", text), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--junit", type=Path, help="existing junit XML of the family tests")
    args = ap.parse_args(argv)
    junit = args.junit
    if junit is None:
        junit = Path(tempfile.mkdtemp()) / "families.xml"
        run_tests(junit)
    table = build_table(outcomes(junit))
    rewrite_readme(table)
    print(table)


if __name__ == "__main__":
    main()
