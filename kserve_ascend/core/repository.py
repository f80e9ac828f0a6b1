"""The model repository: one directory per model in Triton's layout.

    <root>/<model>/config.pbtxt
    <root>/<model>/<version>/model.onnx | model.om | model.sim
"""

from __future__ import annotations

from pathlib import Path

from .errors import ModelNotFound
from .model import Model


class Repository:
    def __init__(self, root: Path | str):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"model repository {self.root} is not a directory")
        self.models: dict[str, Model] = {
            path.name: Model(path.name, path)
            for path in sorted(self.root.iterdir())
            if path.is_dir() and not path.name.startswith(".")
        }

    def get(self, name: str) -> Model:
        try:
            return self.models[name]
        except KeyError:
            # Triton's wording, which clients (and Triton's own examples) match on.
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found") from None

    @property
    def ready(self) -> bool:
        """True when every model of the repository is ready (Triton's strict readiness)."""
        return all(model.ready for model in self.models.values())

    def index(self) -> list[dict]:
        """Triton's repository index: name, version, state and reason of every model."""
        entries = []
        for model in self.models.values():
            if model.versions:
                entries += [
                    {"name": model.name, "version": str(v), "state": model.state.value, "reason": model.reason}
                    for v in sorted(model.versions)
                ]
            else:
                entries.append({"name": model.name, "state": model.state.value, "reason": model.reason})
        return entries
