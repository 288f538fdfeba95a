"""CUDA schedule templates, in match order."""
TEMPLATES: list = []
