"""Pre- and post-processing around a model: pure numpy (and Pillow for decoding), no device, no protocol."""
