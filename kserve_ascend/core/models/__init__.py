"""Models and their versions: a plain version (instances of its own), an ensemble, a model, the repository."""
