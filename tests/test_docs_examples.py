"""The docs' example outputs read the same on every machine: no path from the machine they were
made on."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
# scripts/env.sh makes the venv `.venv` inside a checkout, so such a path names one machine's
# checkout; the docs write a neutral venv instead (/opt/venvs/hpcdl).
CHECKOUT_VENV = re.compile(r"/[\w./-]*/\.venv/")


def test_doctor_example_output_shows_a_neutral_venv_path():
    text = (DOCS / "doctor.md").read_text()
    assert CHECKOUT_VENV.findall(text) == []
    assert "/opt/venvs/hpcdl/bin/hpcdl-stage" in text  # the stager line is still shown


def test_no_docs_page_shows_a_checkout_venv_path():
    found = {p.name: CHECKOUT_VENV.findall(p.read_text()) for p in DOCS.glob("*.md")}
    assert {name: paths for name, paths in found.items() if paths} == {}
