"""`kllm-plugins-cuda`: the `kllm_cuda` SGLang platform's entry point and its process-start guard.

A separate distribution because SGLang, when `SGLANG_PLATFORM` names a platform, skips the general
plugins of every distribution that ships another one: `kllm-plugins` ships `kllm_cpu`, so it must
not also ship `kllm_cuda` (selecting either would then drop the plugins). This one ships no general
plugin, so skipping it when `kllm_cpu` is selected costs nothing. It installs:

- the `sglang.srt.platforms` entry point `kllm_cuda` (code in kllm_plugins.hardware.cuda);
- `kllm_cuda_guard.py` and `kllm_plugins_cuda.pth`, which runs the guard at the start of every
  Python process where `SGLANG_PLATFORM=kllm_cuda` (see kllm_cuda_guard.py's docstring).

Install it non-editable, next to kllm-plugins: `pip install --no-deps hardware/cuda/distribution`
(an editable install would not place the .pth file).
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PTH = "kllm_plugins_cuda.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH), preserve_mode=0)


setup(
    name="kllm-plugins-cuda",
    version="0.1.0",
    description="kllm_cuda: SGLang on NVIDIA GPUs without sgl-kernel (platform entry point and process guard)",
    license="Apache-2.0",
    python_requires=">=3.10",
    py_modules=["kllm_cuda_guard"],
    install_requires=["kllm-plugins"],
    entry_points={"sglang.srt.platforms": ["kllm_cuda = kllm_plugins.hardware.cuda.platform_entry:activate"]},
    cmdclass={"build_py": BuildWithPth},
)
