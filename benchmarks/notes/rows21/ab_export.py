"""Export the symbolic softmax compiled by the tvmfuse on PYTHONPATH: python ab_export.py OUT (run from the repo root)."""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import tvmfuse
from symbolic_rows_softmax import softmax_model
cm = tvmfuse.compile(softmax_model())
tvmfuse.export(cm, sys.argv[1])
print(tvmfuse.__file__)
