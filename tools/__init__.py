"""Developer tools that are not part of the library: the main job (``demo.py``)."""
