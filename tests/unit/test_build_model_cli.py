"""`kllm-plugins build-model tiny` prints the model's path and nothing else on stdout, also when it
builds (scripts read it with `$(...)`; the tokenizer trainer's progress bars once went there)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_build_model_prints_only_the_path_while_building(tmp_path: Path) -> None:
    env = {**os.environ, "KLLM_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "kllm_plugins.cli", "build-model", "tiny"], env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.endswith("\n") and out.count("\n") == 1, repr(out)
    path = Path(out.strip())
    assert path.is_relative_to(tmp_path) and (path / "config.json").is_file()
