import sys, time, os
import tvmfuse
model = sys.argv[1]
t = time.perf_counter()
cm = tvmfuse.compile(f"/work/wt/deberta14/corpus/{model}.onnx")
print(tvmfuse.__file__, model, "compile_s", round(time.perf_counter() - t, 2), "cpu_s", round(time.process_time(), 2))
