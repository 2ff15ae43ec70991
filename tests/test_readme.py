"""The README's promises that a test can hold it to."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    test_block = next(b for b in blocks if 'pip install -e ".[test]"' in b)
    readme_cmd = test_block.split("&&")[-1].strip()
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line and not line.startswith("#")]
    assert ci_lines[-1] == readme_cmd
    assert 'python -m pip install -e ".[test]"' in ci_lines


def test_bundled_example_image_exists() -> None:
    from gguf_mcv.selftest import EXAMPLE_IMAGE

    assert EXAMPLE_IMAGE.is_file() and EXAMPLE_IMAGE.stat().st_size > 0
