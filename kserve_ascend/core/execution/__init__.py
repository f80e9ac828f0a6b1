"""Running batches: an instance (a model file on a device), its thread, its loading and warmup, the runtimes."""
