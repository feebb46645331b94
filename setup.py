"""Maps the design card's top-level folders (plugins/, hardware/) into the one import package
`kllm_plugins`, so nothing bare named `plugins` or `hardware` lands in site-packages."""
from setuptools import find_packages, setup

ROOTS = {"kllm_plugins": "kllm_plugins", "kllm_plugins.plugins": "plugins", "kllm_plugins.hardware": "hardware"}

packages: list[str] = []
package_dir: dict[str, str] = {}
for pkg, folder in ROOTS.items():
    package_dir[pkg] = folder
    packages.append(pkg)
    packages += [f"{pkg}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
