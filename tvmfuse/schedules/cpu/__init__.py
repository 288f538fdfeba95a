"""CPU (llvm) schedule templates, in match order."""
TEMPLATES: list = []
