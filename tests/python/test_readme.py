"""python/README.md's example runs as printed and prints what it says.

The first ```python block of the README runs in a fresh interpreter against
the test daemon (ZIPCACHE_SOCKET, as the README tells a reader to set), and
its output must equal the README's block of printed output after it, line
for line. A README whose example names something undefined, or whose
numbers the code no longer gives, fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO

README = REPO / "python" / "README.md"


def _blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced block as (language, body), in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.S | re.M)


def test_readme_example_runs_as_printed(daemon, tmp_path: Path) -> None:
    blocks = _blocks(README.read_text(encoding="utf-8"))
    languages = [language for language, _ in blocks]
    assert "python" in languages, "python/README.md has no ```python block"
    at = languages.index("python")
    code = blocks[at][1]
    printed = next((body for language, body in blocks[at + 1:] if language == ""), None)
    assert printed is not None, "no block of printed output after the example"

    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ, ZIPCACHE_SOCKET=daemon.socket_path,
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # Run from elsewhere: nothing of the checkout but what PYTHONPATH names.
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"the example failed:\n{result.stderr}"
    assert result.stdout == printed, (
        f"the example printed:\n{result.stdout}\nthe README says:\n{printed}")
