"""`--workers N`: the engine process, its frontend processes, and the typed messages and shared memory between them."""
