"""Build hook: the wheel ships the top-level configs/ as the package data voiceagent/_configs.

The checkout keeps configs/ (default.yaml, the GPU examples, prompts/) at its top level; an
installed package finds them in its own folder (voiceagent.config.CONFIGS_DIR), wherever it
runs. An editable install reads the checkout's configs/ itself, so nothing is copied for it.
Everything else about the package is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONFIGS = Path(__file__).resolve().parent / "configs"
SHIPPED = Path("voiceagent") / "_configs"  # voiceagent.config.SHIPPED_CONFIGS


class BuildPyWithConfigs(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        dest = Path(self.build_lib) / SHIPPED
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(CONFIGS, dest, ignore=shutil.ignore_patterns("__pycache__", ".*"))

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        dest = Path(self.build_lib) / SHIPPED
        return outputs + [str(dest / p.relative_to(CONFIGS)) for p in sorted(CONFIGS.rglob("*"))
                          if p.is_file() and "__pycache__" not in p.parts
                          and not p.name.startswith(".")]


setup(cmdclass={"build_py": BuildPyWithConfigs})
